"""Test helpers shared by the component packages' tests (not used at run time)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

__all__ = ["CHATML", "LoopThread", "tiny_bpe", "wait_until"]


def wait_until(
    condition: Callable[[], object], *, timeout_s: float = 120.0, what: str = "the condition"
) -> None:
    """Wait for another thread or process to reach a state: poll `condition` until it holds.

    `timeout_s` only bounds a hang (an `AssertionError` naming `what`); it is no duration
    the test relies on, so keep it generous: tests run beside others on loaded machines."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s:g} s")
        time.sleep(pause)  # polls the state itself; the pause only spaces the polls
        pause = min(pause * 2, 0.05)


class LoopThread:
    """Calls `step()` over and over in a thread until `stop()`, keeping what it raised
    (`error`) for the test to surface: drives one component's loop from one thread."""

    def __init__(self, step: Callable[[], object]) -> None:
        self.step = step
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.step()
        except BaseException as error:  # surfaced by the test
            self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            raise AssertionError("the loop thread did not stop within 30 s")


# A Qwen/ChatML-style template using the features real templates rely on.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set rest = messages %}{%- endif %}\n"
    "{%- for m in rest %}\n"
    "    {%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
    "    {{- '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_bpe() -> tokenizers.Tokenizer:
    """A 300-token byte-level BPE trained here on one sentence, with ChatML's special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=alphabet,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, what is 2+2? the answer is 4."] * 20, trainer=trainer)
    return tok
