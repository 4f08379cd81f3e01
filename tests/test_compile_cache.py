"""The start-up note about an empty Triton cache: where Triton compiles, and when to say so."""

from pathlib import Path

from tinyoss.kernels.compile_cache import empty_cache_note, triton_cache_dir


def test_triton_cache_dir_follows_triton_s_own_rules(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert triton_cache_dir() == tmp_path / ".triton" / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert triton_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("TRITON_HOME")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert triton_cache_dir() == Path.home() / ".triton" / "cache"


def test_the_note_appears_only_while_the_cache_holds_nothing(monkeypatch, tmp_path):
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv("TINYOSS_CACHE", str(tmp_path / "tinyoss"))
    for state in ("missing", "empty"):
        if state == "empty":
            cache.mkdir()
        note = empty_cache_note()
        assert note is not None and str(cache) in note and str(tmp_path / "tinyoss") in note
        assert "TRITON_CACHE_DIR" in note and "volume" in note
    (cache / "abc123").mkdir()
    assert empty_cache_note() is None
