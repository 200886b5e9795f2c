"""Drop-in replacements for other libraries' I/O interfaces, built on aionvme.

- :mod:`aionvme.compat.deepspeed`: DeepNVMe's ``aio_handle`` (DeepSpeed ZeRO
  NVMe offload), with ``install()`` so DeepSpeed's ``AsyncIOBuilder().load()``
  returns it.
"""
