"""``import aionvme`` stays light: no framework, serving engine or Ray is loaded by it.

The optional dependencies live only in ``aionvme.integrations.<framework>`` and
``aionvme.data.ray``; importing the package, its capabilities and the
integrations package itself must not load any of them (they cost seconds and
gigabytes, and a user of one need not have the others).
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = (
    "vllm",
    "sglang",
    "lmcache",
    "ray",
    "lightning",
    "pytorch_lightning",
    "diffusers",
    "accelerate",
    "transformers",
    "deepspeed",
    "streaming",
)

CODE = """
import json, sys
import aionvme, aionvme.store, aionvme.data, aionvme.offload, aionvme.dcp, aionvme.integrations
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))
"""


def test_import_aionvme_loads_no_framework() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "aionvme" in loaded  # the probe did import the package
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))
