"""The demo's reward is computed from the text the model sampled, nothing else."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import pytest
import respx

from proxy.demo import task
from proxy.demo.driver import Driver
from proxy.demo.task import Prompt, answer_text, session_reward, turn_score


@pytest.mark.parametrize(
    "sampled, threshold, expected",
    [
        ("<think>\n\n</think>\n\n99999<|im_end|>", 7, 1.0),
        ("<think>\n\n</think>\n\n12345<|im_end|>", 7, 0.0),
        ("<think>\n\n</think>\n\n97321<|im_end|>", 7, 0.4),
        ("<think>\n\n</think>\n\n97321<|im_end|>", 3, 0.6),  # same text, other prompt
        ("99999", 8, 1.0),  # parsed message text (no reasoning) grades the same
        ("9999", 8, 0.0),  # four digits: wrong length
        ("999999", 8, 0.0),  # six digits: wrong length
        ("9a9b9", 8, 0.6),  # non-digits earn nothing
        ("<think>\nnever closed 99999", 8, 0.0),  # no answer outside the reasoning
        ("", 6, 0.0),
    ],
)
def test_turn_score(sampled, threshold, expected):
    assert turn_score(sampled, threshold) == pytest.approx(expected)


def test_changing_the_sampled_text_changes_the_reward():
    base = ["<think>\n\n</think>\n\n71234<|im_end|>", "<think>\n\n</think>\n\n88123<|im_end|>"]
    r0 = session_reward(base, 7)
    assert r0 == pytest.approx((0.2 + 0.4) / 2)
    rng = random.Random(0)
    for _ in range(50):  # any single-digit edit moves the reward by exactly 1/10 or not at all, as the rule says
        turn, pos = rng.randrange(2), rng.randrange(5)
        head = len("<think>\n\n</think>\n\n")
        text = base[turn]
        old = text[head + pos]
        new = str(rng.randrange(10))
        edited = list(base)
        edited[turn] = text[: head + pos] + new + text[head + pos + 1 :]
        delta = ((int(new) >= 7) - (int(old) >= 7)) / 10
        assert session_reward(edited, 7) == pytest.approx(r0 + delta)
    assert session_reward(["99999", "99999"], 7) == 1.0
    assert session_reward(["99999"], 7) == 0.5  # the second turn never happened: it scores 0


def test_turn_two_depends_on_turn_one():
    p = Prompt(7)
    assert p.turn2("97123") != p.turn2("12345")
    assert "97123" in p.turn2("97123") and "2 of 5" in p.turn2("97123")
    assert answer_text("<think>\nx\n</think>\n\n 42 <|im_end|>") == "42"


def test_warm_start_pairs_teach_the_format_not_the_answer():
    pairs = task.warm_start_pairs(400, seed=3)
    assert pairs == task.warm_start_pairs(400, seed=3) and pairs != task.warm_start_pairs(400, seed=4)
    digits = []
    for row in pairs:
        assert row["prompt"].endswith("<|im_start|>assistant\n")
        assert row["completion"].startswith(task.THINK) and row["completion"].endswith(task.IM_END)
        answer = answer_text(row["completion"])
        assert len(answer) == 5 and answer.isdigit()
        digits += [int(c) for c in answer]
    # uniform digits: the warm-started model starts near chance, RL has the rest to learn
    assert abs(sum(d >= 7 for d in digits) / len(digits) - 0.3) < 0.05
    assert any(row["prompt"].count("<|im_start|>user") == 2 for row in pairs)  # turn-2 layouts too
    assert task.chance_reward() == pytest.approx(0.3)


def test_driver_grades_what_the_agent_got_back(monkeypatch):
    """The reward posted for a session is the task's score of the two final outputs the agent
    received (the parsed text of the sampled ids), and turn 2's message quotes turn 1's."""
    import agents

    sampled = iter(["97111", "99979"])
    seen_inputs = []

    async def fake_run(agent, input, max_turns):
        seen_inputs.append(input)
        text = next(sampled)
        return SimpleNamespace(final_output=text, to_input_list=lambda: [{"role": "user", "content": "q"},
                                                                        {"role": "assistant", "content": text}])

    monkeypatch.setattr(agents.Runner, "run", fake_run)
    posted = {}
    with respx.mock:
        respx.post(url__regex=r"http://proxy\.test/v1/sessions/.+/reward").mock(
            side_effect=lambda req: posted.update({req.url.path: json.loads(req.content)["reward"]}) or httpx.Response(200, json={})
        )
        d = Driver(base="http://proxy.test", model_name="m", group_size=1, groups_per_step=1, steps=1, lead=0,
                   concurrency=1, max_output_tokens=16, seed=0, steps_done=lambda: 0)
        result = asyncio.run(d.run_session("s1", "g1", Prompt(7)))
    assert result.answers == ["97111", "99979"]
    assert result.reward == pytest.approx((0.4 + 1.0) / 2)
    assert posted == {"/v1/sessions/s1/reward": result.reward}
    assert seen_inputs[0] == Prompt(7).turn1()
    assert seen_inputs[1][-1] == {"role": "user", "content": Prompt(7).turn2("97111")}
