"""tools/bench_prepare_data.py: the tool and encode_batch tokenize the same corpus; the ratio and the
token count come back (a tiny corpus: the plumbing, not the rate)."""
import json

import pytest

from tools import bench_prepare_data


def test_the_bench_times_both_and_writes_its_ratio(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    out = tmp_path / "rate.json"
    assert bench_prepare_data.main(["--mb", "0.3", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] > 0 and result["documents"] > 1
    assert result["rate_ratio"] > 0 and result["encode_batch_s"] > 0 and result["prepare_data_s"] > 0
    assert "its rate (target 0.9x)" in capsys.readouterr().out
