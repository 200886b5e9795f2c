"""aionvme.integrations: thin adapters that put aionvme under the frameworks users already run.

One module per framework; each imports its framework only inside itself, so
``import aionvme`` (and ``import aionvme.integrations``) never loads one:

- KV-cache tiers of serving engines, over :class:`aionvme.TieredStore`:
  ``vllm``, ``sglang``, ``lmcache``.
- Training and inference frameworks: ``accelerate`` (disk offload),
  ``diffusers`` (group offloading to disk), ``lightning`` (CheckpointIO),
  ``transformers`` (from_pretrained of a local sharded safetensors model).
"""
