"""tools/bench_nodes.py: the simulated nodes' launch (one torchrun agent a node, static rendezvous, the
socket transport's environment) and the bytes a rank sends, read from NCCL's records in a trace. The
end-to-end run is `python3 tools/bench_nodes.py --smoke` (CPU gloo, about 2 minutes: not in the suite)."""
import json

import pytest

from tools import bench_nodes


def _record(kind: str, dim: str, nelems_in: int, nelems_out: int, dtype: str = "Float",
            size: int = 2) -> dict:
    """A record_param_comms event as torch 2.11's NCCL process group writes it (seen in a real trace)."""
    return {"name": "record_param_comms", "cat": "cpu_op",
            "args": {"Collective name": kind, "Process Group Description": f"mesh_{dim}", "Group size": size,
                     "In msg nelems": nelems_in, "Out msg nelems": nelems_out, "dtype": dtype}}


def test_ring_bytes_per_collective():
    mib = 2 ** 20
    two = _record("allreduce", "tp", mib, mib, "BFloat16")["args"]
    assert bench_nodes.message_bytes(two) == (2 * mib, 2 * mib)
    four = _record("allreduce", "dp", mib, mib, size=4)["args"]
    assert bench_nodes.message_bytes(four) == (4 * mib, 1.5 * 4 * mib)   # 2 (n - 1) / n of the buffer
    gather = _record("_allgather_base", "dp", mib, 2 * mib)["args"]
    assert bench_nodes.message_bytes(gather) == (8 * mib, 4 * mib)       # its own shard to the other rank
    scatter = _record("_reduce_scatter_base", "dp", 2 * mib, mib)["args"]
    assert bench_nodes.message_bytes(scatter) == (8 * mib, 4 * mib)
    assert bench_nodes.message_bytes(_record("send", "cp", mib, 0)["args"]) == (4 * mib, 4 * mib)
    assert bench_nodes.message_bytes(_record("recv", "cp", 0, mib)["args"])[1] == 0


def test_bytes_per_step_are_summed_by_mesh_dimension_and_kind(tmp_path):
    events = [_record("_allgather_base", "dp", 100, 200), _record("_allgather_base", "dp", 100, 200),
              _record("send", "cp", 50, 0), {"name": "aten::mm", "cat": "cpu_op", "args": {}}]
    (tmp_path / "trace_rank1.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "buckets_rank1.json").write_text(json.dumps({"steps": [5, 6]}))   # two profiled steps
    result = bench_nodes.comm_bytes(tmp_path)
    assert set(result) == {1}
    assert result[1]["dp _allgather_base"] == {"calls": 2, "payload_bytes": 800.0, "sent_bytes": 400.0}
    assert result[1]["cp send"]["sent_bytes"] == 100.0
    assert "dp 0.0 MiB" in bench_nodes._sent_by_dimension(result[1])


def test_one_agent_a_node_with_its_own_gpus_and_the_socket_transport(tmp_path):
    commands = bench_nodes.agent_commands(2, 2, "configs/h1-1.3b.yaml", ["parallel.cp=4"], tmp_path, 30, 10,
                                          29400)
    assert len(commands) == 2
    for node, command in enumerate(commands):
        assert "--nnodes=2" in command and f"--node-rank={node}" in command
        assert "--master-port=29400" in command
        assert "--standalone" not in command      # a static rendezvous, as nodes of a cluster start
        assert "parallel.cp=4" in command and f"train.profile_steps={bench_nodes.PROFILED_STEP}" in command
    env = bench_nodes.agent_environment(1, 2, "socket", on_gpu=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SHM_DISABLE"] == "1" and env["NCCL_NET"] == "Socket"
    assert env["NCCL_HOSTID"] != bench_nodes.agent_environment(0, 2, "socket", on_gpu=True)["NCCL_HOSTID"]
    local = bench_nodes.agent_environment(0, 1, "local", on_gpu=True)
    assert local["CUDA_VISIBLE_DEVICES"] == "0"
    untouched = [*bench_nodes.SOCKET_ENV, "NCCL_HOSTID"]     # the machine's own links: as the caller's
    assert all(local.get(name) == bench_nodes.os.environ.get(name) for name in untouched)


def test_layouts_put_each_dimension_across_the_nodes():
    names = [name for _, name, _ in bench_nodes.layouts(2, 1, smoke=False)]
    assert names == ["cp 2 across the nodes", "dp 2 across the nodes"]
    two_a_node = bench_nodes.layouts(2, 2, smoke=False)
    dim, name, settings = two_a_node[-1]
    assert dim == "cp" and "parallel.cp=2" in settings and "parallel.dp=2" in settings
    assert "dp 2 across x cp 2 within" == name


def test_bad_arguments_name_the_flag():
    with pytest.raises(SystemExit):
        bench_nodes.parse_args(["--nodes", "1"])
    with pytest.raises(SystemExit):
        bench_nodes.parse_args(["--transports", "infiniband"])
    with pytest.raises(SystemExit):
        bench_nodes.parse_args(["--skip", str(bench_nodes.PROFILED_STEP)])
