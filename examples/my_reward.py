"""A user reward function: set ``reward.fn = "examples/my_reward.py:score"`` (see examples/my_reward.toml).

LongStraw calls ``score(response, answer, **meta, **options)`` for every response: ``answer`` and ``meta`` come
from the data (a built-in task's metadata, or the other fields of a prompt-file row), ``options`` is the
``[reward] options`` table. The call runs in a worker process with ``reward.timeout_s`` seconds per call; an
exception, a result that is not a finite number, or a timeout scores 0.0 and is counted in ``reward_errors`` of
``metrics.jsonl``, without stopping the run. The file is imported when the trainer starts (not when the config is
loaded): an import error is reported then.
"""


def score(response: str, answer: str, *, partial: float = 0.5, **meta) -> float:
    """1.0 for exactly the answer; otherwise ``partial`` times the fraction of the answer's characters that the
    response has in the same places (a shaped reward: near misses earn something, so a group's rewards differ)."""
    r, a = response.strip(), answer.strip()
    if r == a:
        return 1.0
    if not a:
        return 0.0
    same = sum(x == y for x, y in zip(r, a))
    return partial * same / max(len(r), len(a))
