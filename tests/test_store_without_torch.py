"""The store where torch is not installed: numpy values work, and asking for torch tensors is
the typed TorchNotInstalledError the README documents, never a raw ModuleNotFoundError."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from test_readme import _WITHOUT_TORCH

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import aionvme as nvme

    np.arange(4096, dtype=np.float32).tofile("weights.bin")
    with nvme.SyncTieredStore("store", host="1M") as store:
        store.put("n", np.arange(10, dtype=np.int16))
        assert store.get("n").tolist() == list(range(10))
        store.attach("np", "weights.bin", 4096, (1024,), "float32", like="numpy")
        assert store.get("np")[:3].tolist() == [1024.0, 1025.0, 1026.0]
        try:
            store.attach("t", "weights.bin", 4096, (1024,), "float32")  # like="torch", the default
        except nvme.TorchNotInstalledError as e:
            assert isinstance(e, ModuleNotFoundError) and "like='numpy'" in str(e), e
        else:
            sys.exit("get of a torch value without torch did not raise")
    assert "torch" not in sys.modules
    """
)


def test_numpy_values_work_and_torch_values_say_torch_is_missing(tmp_path):
    script = tmp_path / "block.py"
    script.write_text(SCRIPT)
    r = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TORCH, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
