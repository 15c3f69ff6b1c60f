"""Fixtures: one tiny model per session, engines served over loopback, a direct-forward oracle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engines.reference.lm import load_tokenizer
from engines.reference.model_init import init_model, perturb_model
from engines.reference.testing import start_engine, start_engine_in_thread

TOKEN_DELAY_S = 0.01  # slow enough that a pause lands mid-generation, fast enough for the suite

SCRIPT = [
    "<think>\nplan the call\n</think>\n\n<tool_call>\n"
    '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
    "The answer is 3. STOP here, please.<|im_end|>",
    "A third reply without an end token",
]


@pytest.fixture(scope="session")
def script_texts():
    return list(SCRIPT)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return init_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def perturbed_dir(model_dir, tmp_path_factory):
    return perturb_model(model_dir, tmp_path_factory.mktemp("tiny-qwen3-v1"), seed=1, scale=0.2)


class Oracle:
    """Direct (non-incremental) forward passes of a model dir: the ground truth for logprobs."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.tokenizer = load_tokenizer(model_dir)

    @torch.inference_mode()
    def logprobs(self, ids: list[int], temperature: float = 1.0) -> list[float | None]:
        """Entry i = log p(ids[i] | ids[:i]) at ``temperature``; entry 0 is None."""
        logits = self.model(torch.tensor([ids])).logits[0].float()
        lsm = torch.log_softmax(logits / temperature, dim=-1)
        return [None] + [float(lsm[i - 1, ids[i]]) for i in range(1, len(ids))]

    def chat_prompt(self, text: str) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="session")
def oracle(model_dir):
    return Oracle(model_dir)


@pytest.fixture(scope="session")
def oracle_v1(perturbed_dir):
    return Oracle(perturbed_dir)


@pytest.fixture(scope="session")
def engine(model_dir):
    """Base URL of a sampling engine (in a thread of this process), 10 ms per token."""
    url, stop = start_engine_in_thread(model_dir, token_delay_s=TOKEN_DELAY_S, weight_version="0", served_model_name="tiny")
    yield url
    stop()


@pytest.fixture(scope="session")
def script_engine(model_dir):
    """Base URL of a script-mode engine emitting ``SCRIPT`` at 20 ms per token."""
    url, stop = start_engine_in_thread(model_dir, script=SCRIPT, script_delay_s=0.02)
    yield url
    stop()


@pytest.fixture(scope="session")
def subprocess_engine(request, model_dir, script_texts):
    """A ``start_engine`` subprocess, launched when first asked for (not at session start: its
    health polls would run beside other tests' respx mocks, which intercept every httpx call).

    Yields a future of ``(url, stop)``; None when no test in the session needs it.
    """
    if not any("test_subprocess" in item.nodeid for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(start_engine, model_dir, script=script_texts[:1], weight_version="3", served_model_name="tiny-sub")
        yield fut
        try:
            fut.result()[1]()
        except Exception:
            pass  # the test reports start failures
