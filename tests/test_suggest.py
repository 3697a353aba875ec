"""Close-match hints in error messages (recsys/_suggest.py)."""

from __future__ import annotations

from recsys._suggest import did_you_mean, quoted_with_hints


def test_did_you_mean_picks_the_closest_candidate():
    candidates = ["batch_size", "eval_batch_size", "seed"]
    assert did_you_mean("batchsize", candidates) == " (did you mean 'batch_size'?)"
    assert did_you_mean("eval_batchsize", candidates) == " (did you mean 'eval_batch_size'?)"


def test_did_you_mean_says_nothing_without_a_close_candidate():
    assert did_you_mean("zzzz", ["batch_size", "seed"]) == ""
    assert did_you_mean("seed", []) == ""


def test_quoted_with_hints_quotes_every_name_and_hints_each_one():
    # A generator of candidates: it is read once for all names.
    candidates = (name for name in ["t_cat_0", "t_cat_10", "dense"])
    assert quoted_with_hints(["t_cat_1", "xyz", "dens"], candidates) == (
        "'t_cat_1' (did you mean 't_cat_10'?), 'xyz', 'dens' (did you mean 'dense'?)"
    )
    assert quoted_with_hints([], ["a"]) == ""


def test_a_taken_name_is_never_suggested():
    # A file missing cat_3 that holds cat_23 (which the model reads as itself).
    assert did_you_mean("cat_3", ["cat_23", "label"], taken=["cat_3", "cat_23"]) == ""
    assert did_you_mean("cat_3", ["cat_23", "Cat_3"], taken=["cat_23"]) == (
        " (did you mean 'Cat_3'?)"
    )
    assert quoted_with_hints(["cat_3"], ["cat_23"], taken=["cat_23"]) == "'cat_3'"
