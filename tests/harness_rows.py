"""What compute mode's rows in an ab file must say, checked the same way wherever a test runs
the harness (tests/bench/test_bench_e2e.py's default path, tests/project/test_docs_commands.py's
README command)."""

from vmcache.bench import real


def check_compute_rows(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Both caches; four radix rows, each with prefix hits exactly when prefix caching is on;
    where the embedded model is cached, the real-model rows: both caches, the same answers on
    both, a prefix hit behind the shared prompt. Returns (compute rows, real-model rows)."""
    compute = [r for r in rows if r.get("mode") == "compute"]
    radix = [r for r in compute if r.get("scenario") == "shared_prompt"]
    assert {r["cache"] for r in compute} == {"vmcache", "paged"} and len(radix) == 4
    assert all((r["prefix_hit_tokens"] > 0) == r["prefix_caching"] for r in radix)
    served = [r for r in rows if r.get("mode") == "compute_real"]
    if real.available():
        assert {r["cache"] for r in served} == {"vmcache", "paged"}
        assert all(r.get("answers_equal_across_caches", True) for r in served)
        assert any(r.get("prefix_hit_tokens", 0) > 0 for r in served)
    return compute, served
