"""aionvme.data.ray: an aionvme dataset read by Ray Data on a two-node Ray
cluster on this machine (ray.cluster_utils.Cluster: two raylets, one CPU each);
every sample arrives exactly once, bytes equal to what was written, and the
read tasks run on both nodes."""

from __future__ import annotations

import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs ray[data]: the optional Ray Data datasource")
pytest.importorskip("ray.data", reason="needs ray[data]: the optional Ray Data datasource")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.data.datasource import ReadTask  # noqa: E402

from aionvme.data import CorruptDatasetError, Dataset, sync_write_dataset  # noqa: E402
from aionvme.data.ray import AionvmeDatasource  # noqa: E402

pytestmark = pytest.mark.peers

# the read-task wrapper below travels to Ray's workers by value (they cannot import tests/)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 300


def make_samples():
    rng = np.random.default_rng(5)
    return [
        {
            "id": np.int64(i),
            "x": rng.integers(0, 256, 4096 + 97 * (i % 13), dtype=np.uint8),  # varies: a ragged column
            "y": rng.standard_normal((3, 5)).astype(np.float32),
        }
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False},
    )
    c.add_node(num_cpus=1, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    # Ray Data opens its log file at its first run, and keeps it: here, not inside a test
    # (the suite's check for files a test leaves open)
    ray.data.range(1).take_all()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


class NodeTagged(AionvmeDatasource):
    """The datasource, each block also naming the node its read task ran on."""

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        return [
            ReadTask(_Tagged(t.read_fn), t.metadata, per_task_row_limit=per_task_row_limit)
            for t in super().get_read_tasks(parallelism, per_task_row_limit, data_context)
        ]


class _Tagged:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        import pyarrow as pa

        node = ray.get_runtime_context().get_node_id()
        for block in self.fn():
            yield block.append_column("node", pa.array([node] * block.num_rows))


def test_two_nodes_read_every_sample_once(cluster, tmp_path):
    samples = make_samples()
    path = tmp_path / "ds"
    sync_write_dataset(path, samples, shard_size="256K")
    src = NodeTagged(path, index_column="sample", block_size="64K", verify=True)
    tasks = src.get_read_tasks(6)
    assert sum(t.metadata.num_rows for t in tasks) == N
    assert src.estimate_inmemory_data_size() == sum(s["x"].nbytes + 8 + 60 for s in samples)
    ds = ray.data.read_datasource(src, override_num_blocks=6)
    rows = ds.take_all()
    ids = sorted(int(r["sample"]) for r in rows)
    assert ids == list(range(N))  # every sample exactly once
    for r in rows:
        s = samples[int(r["sample"])]
        assert int(r["id"]) == int(s["id"])
        assert np.array_equal(np.asarray(r["x"]), s["x"]) and np.array_equal(np.asarray(r["y"]), s["y"])
    nodes = {r["node"] for r in rows}
    assert nodes <= {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2, "the read tasks ran on one node only"


def test_damage_reaches_the_consumer_as_aionvme_error(cluster, tmp_path):
    path = tmp_path / "ds"
    sync_write_dataset(path, make_samples()[:40], shard_size="1M")
    with Dataset(path) as d:  # flip one byte of sample 7's field x
        f = d.layout.fields["x"]
        shard, off = d.layout.files[int(f.file[7])], int(f.offset[7]) + 100
    with open(shard, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0xFF]))
    ds = ray.data.read_datasource(AionvmeDatasource(path, verify=True), override_num_blocks=2)
    with pytest.raises(Exception) as e:
        ds.take_all()
    # Ray wraps a task's error in a RayTaskError that is also an instance of the cause's type
    assert isinstance(e.value, CorruptDatasetError), repr(e.value)
    assert "checksum" in str(e.value) and "sample 7" in str(e.value)
