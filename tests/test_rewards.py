import functools
import math

import numpy as np
import pytest

from ppojax.rl.rewards import (
    RewardFunction,
    RewardFunctionError,
    call_reward_function,
    check_scores,
    vader_sentiment_reward,
)

PROMPTS = ["The movie", "The plot", "The cast"]
COMPLETIONS = [" was great.", " was dull.", " was fine."]


def test_vader_numbers_from_assets():
    fn = vader_sentiment_reward()
    assert isinstance(fn, RewardFunction)
    sentences = [
        "The movie was wonderful and the acting was great.",
        "The movie was boring and awful.",
        "The movie was a movie.",
    ]
    scores = call_reward_function(fn, [""] * 3, sentences)
    assert scores.dtype == np.float32 and scores.shape == (3,)
    np.testing.assert_allclose(scores, [0.832, -0.649, 0.0], atol=1e-3)


def test_vader_scores_completion_only_by_default():
    prompts = ["A gorgeous, witty, seductive movie."]
    completions = ["It was a movie."]
    assert vader_sentiment_reward()(prompts, completions) == [0.0]
    assert vader_sentiment_reward(include_prompt=True)(prompts, completions)[0] > 0.5


def test_valid_scores_any_sequence():
    for out in ([1, 2, 3], (1.0, 2.0, 3.0), np.array([1, 2, 3], np.float64), np.array([[1], [2], [3]])):
        np.testing.assert_array_equal(check_scores(out, 3), np.float32([1, 2, 3]))


def test_reward_function_that_raises():
    def my_reward(prompts, completions):
        raise KeyError("sentiment model not loaded")

    with pytest.raises(RewardFunctionError,
                       match=r"reward function .*my_reward raised KeyError: 'sentiment model not loaded'") as info:
        call_reward_function(my_reward, PROMPTS, COMPLETIONS)
    assert isinstance(info.value.__cause__, KeyError)  # the original is chained


def test_callable_object_and_partial_are_named():
    class Scorer:
        def __call__(self, prompts, completions):
            raise RuntimeError("boom")

    with pytest.raises(RewardFunctionError, match="Scorer instance raised RuntimeError: boom"):
        call_reward_function(Scorer(), PROMPTS, COMPLETIONS)

    def base(prompts, completions, k):
        return [k] * 2

    with pytest.raises(RewardFunctionError, match=r"partial\(.*base\) returned 2 scores for 3 prompts"):
        call_reward_function(functools.partial(base, k=1.0), PROMPTS, COMPLETIONS)


def test_wrong_length():
    with pytest.raises(RewardFunctionError, match=r"returned 2 scores for 3 prompts; expected 3"):
        call_reward_function(lambda p, c: [0.0, 1.0], PROMPTS, COMPLETIONS)
    with pytest.raises(RewardFunctionError, match=r"shape \(3, 2\); expected shape \(3,\)"):
        check_scores(np.zeros((3, 2)), 3)
    with pytest.raises(RewardFunctionError, match="not a sequence of numbers"):
        check_scores(["good", "bad", "ok"], 3)
    with pytest.raises(RewardFunctionError, match="not a sequence of numbers"):
        check_scores(None, 3)
    with pytest.raises(RewardFunctionError, match="not a sequence of numbers"):
        check_scores(1.0, 3)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_names_prompt_index(bad):
    with pytest.raises(RewardFunctionError, match=rf"returned {bad!r} for prompt index 1 \('The plot'\)"):
        call_reward_function(lambda p, c: [0.5, bad, 0.1], PROMPTS, COMPLETIONS)


def test_float32_overflow_is_caught():
    with pytest.raises(RewardFunctionError, match=r"returned 1e\+300 \(overflows float32\) for prompt index 1; scores"):
        check_scores([0.0, 1e300, 0.0], 3)
    with pytest.raises(RewardFunctionError, match=r"returned nan for prompt index 0 \(and 2 more\)"):
        check_scores([math.nan, 0.0, 1e300, math.inf], 4)
