"""benchmarks/rest_hop.py runs both paths end to end: every chunk of every stream arrives on
each (the script raises otherwise), and the timings and their ratio are reported."""

from __future__ import annotations

from benchmarks import rest_hop


def test_both_paths_stream_every_chunk_and_a_ratio_is_reported() -> None:
    result = rest_hop.main(["--requests", "4", "--chunks", "5", "--concurrency", "2", "--rounds", "1"])
    for kind in ("cpu", "wall"):
        assert result[f"in_process_{kind}_us_per_chunk"] > 0 and result[f"grpc_hop_{kind}_us_per_chunk"] > 0
