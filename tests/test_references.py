"""The single-process references the parity tests compare against: kept on disk between test processes
(models.REFERENCE_CACHE), they must come back exactly as trained, and other arguments must train anew."""

import models


def test_a_cached_reference_is_the_one_trained_and_other_arguments_train_anew(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "REFERENCE_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_REFERENCES", {})
    trained = models.reference_run("gpt", {}, 3, 4)
    assert len(list(tmp_path.iterdir())) == 1
    monkeypatch.setattr(models, "_REFERENCES", {})  # another test process: from the file
    monkeypatch.setattr(models, "_train_reference", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained")))
    loaded = models.reference_run("gpt", {}, 3, 4)
    assert loaded[0] == trained[0] and loaded[2] == trained[2]
    assert set(loaded[1]) == set(trained[1]) and all((loaded[1][k] == v).all() for k, v in trained[1].items())
    try:  # another step count is another reference
        models.reference_run("gpt", {}, 4, 4)
    except AssertionError as e:
        assert "trained" in str(e)
    else:
        raise AssertionError("a reference with other arguments came from the cache")
