"""The demo's agents: openai-agents sessions playing the two-turn task through the proxy.

Groups are launched while the trainer trains, at most ``lead`` training steps ahead of it and,
once the trainer's pace is known, spread evenly over a step, so generation is under way when
the trainer publishes new weights (updates land mid-generation) and samples are at most a
version or two stale.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from .task import Prompt, sample_prompt, session_reward


@dataclass
class SessionResult:
    session_id: str
    group_id: str
    threshold: int
    answers: list[str]
    reward: float
    error: str | None = None


@dataclass
class Driver:
    base: str  # proxy base URL
    model_name: str
    group_size: int
    groups_per_step: int
    steps: int
    lead: int
    concurrency: int
    max_output_tokens: int
    seed: int
    steps_done: Callable[[], int]  # training steps finished so far
    trainer: subprocess.Popen | None = None
    admin_headers: dict[str, str] = field(default_factory=dict)  # the grader posts rewards with the admin token
    results: list[SessionResult] = field(default_factory=list)
    launched: int = 0  # sessions
    running: int = 0

    async def run_session(self, sid: str, gid: str, prompt: Prompt) -> SessionResult:
        from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner
        from openai import AsyncOpenAI

        headers = {"X-Session-Id": sid, "X-Group-Id": gid, "X-Group-Size": str(self.group_size)}
        client = AsyncOpenAI(base_url=self.base + "/v1", api_key="demo", default_headers=headers, max_retries=5, timeout=300)
        agent = Agent(
            name="digits",
            model=OpenAIResponsesModel(model=self.model_name, openai_client=client),
            model_settings=ModelSettings(max_tokens=self.max_output_tokens),
        )
        answers: list[str] = []
        error = None
        try:
            first = await Runner.run(agent, prompt.turn1(), max_turns=1)
            answers.append(str(first.final_output or ""))
            # turn 2 replays the whole history (reasoning item included): the proxy splices it
            history = first.to_input_list() + [{"role": "user", "content": prompt.turn2(answers[0])}]
            second = await Runner.run(agent, history, max_turns=1)
            answers.append(str(second.final_output or ""))
        except Exception as exc:  # e.g. a turn with no message: the episode fails and still gets graded
            error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            await client.close()
        reward = session_reward(answers, prompt.threshold)
        async with httpx.AsyncClient(timeout=60, headers=self.admin_headers) as h:
            r = await h.post(f"{self.base}/v1/sessions/{sid}/reward", json={"reward": reward})
            r.raise_for_status()
        return SessionResult(sid, gid, prompt.threshold, answers, reward, error)

    def _allowed_groups(self) -> int:
        return min(self.steps + self.lead, self.steps_done() + 1 + self.lead) * self.groups_per_step

    def _trainer_alive(self) -> bool:
        return self.trainer is None or self.trainer.poll() is None

    async def run(self) -> list[SessionResult]:
        """Launch groups until the trainer is done (or the last step's data is out); wait for them."""
        from agents import set_tracing_disabled

        set_tracing_disabled(True)
        # a failed episode (e.g. no end of turn within max_output_tokens) is graded 0 and counted
        # in the summary; the SDK's own error log would only break up the progress lines
        logging.getLogger("openai.agents").setLevel(logging.CRITICAL)
        rng = random.Random(self.seed)
        sem = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()

        async def one(sid: str, gid: str, prompt: Prompt) -> None:
            async with sem:
                self.running += 1
                try:
                    self.results.append(await self.run_session(sid, gid, prompt))
                finally:
                    self.running -= 1

        g = 0
        seen, seen_at, durations = 0, time.monotonic(), []
        last_launch = -math.inf
        while self._trainer_alive():
            n, now = self.steps_done(), time.monotonic()
            if n > seen:
                durations.append((now - seen_at) / (n - seen))
                seen, seen_at = n, now
            # Once the trainer's pace is known, spread a step's groups over one step, so that
            # turns are being generated whenever it publishes.
            interval = sum(durations[-3:]) / len(durations[-3:]) / self.groups_per_step if durations else 0.0
            if g < self._allowed_groups() and now - last_launch >= interval:
                prompt = sample_prompt(rng)
                gid = f"demo-g{g}"
                for k in range(self.group_size):
                    tasks.add(asyncio.ensure_future(one(f"{gid}-s{k}", gid, prompt)))
                    self.launched += 1
                g += 1
                last_launch = now
                continue
            tasks = {t for t in tasks if not t.done()}
            await asyncio.sleep(0.05)
        if tasks:
            await asyncio.gather(*tasks)
        return self.results
