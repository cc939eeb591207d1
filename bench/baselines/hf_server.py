"""The transformers baseline: an OpenAI-compatible server that runs one request at a time.

``model.generate`` with a streamer, behind a lock: the way a user serves a model with
nothing but transformers. Serves ``/v1/completions`` (prompt as text or a list of token
ids; ``max_tokens``; ``ignore_eos``; greedy at temperature 0, sampling otherwise; streamed
with a final usage chunk when ``stream_options.include_usage``), ``/v1/models`` and
``/health``.

``ignore_eos`` sets ``min_new_tokens = max_new_tokens = max_tokens``, so EOS is masked until
exactly ``max_tokens`` tokens exist. The streamer is a ``TextIteratorStreamer`` that emits
per token (the stock one holds text back to the last space, which would hide the real ITL)
and never emits a partial UTF-8 character.

    python bench/baselines/hf_server.py --model DIR --port 8100 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import uuid
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import orjson  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, TextIteratorStreamer  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class TokenStreamer(TextIteratorStreamer):
    """Puts ``(text, n_tokens)`` per generated token on the queue; ``None`` at the end.

    Text is the newly decoded suffix of all generated tokens so far; while it ends in an
    incomplete character (U+FFFD) nothing is emitted and the tokens ride on the next item.
    """

    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.ids: list[int] = []
        self.sent = 0  # characters already emitted
        self.pending = 0  # tokens not yet emitted

    def put(self, value: torch.Tensor) -> None:
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.ids.extend(value.reshape(-1).tolist())
        self.pending += value.numel()
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.text_queue.put((text[self.sent :], self.pending))
        self.sent, self.pending = len(text), 0

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.pending or len(text) > self.sent:
            self.text_queue.put((text[self.sent :], self.pending))
        self.text_queue.put(self.stop_signal)


class Cancelled(StoppingCriteria):
    """Stops ``generate`` when the client has gone."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        return self.event.is_set()


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def create_app(model_dir: Path, dtype: str, served_name: str | None = None, device: str = "cpu") -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval().to(device)
    name = served_name or model_dir.name
    lock = asyncio.Lock()  # one request at a time: this is the baseline
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt per request
        if isinstance(prompt, str):
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
        else:
            ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        gen_kwargs = dict(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
            do_sample=temperature > 0, pad_token_id=tokenizer.eos_token_id,
        )
        if temperature > 0:
            gen_kwargs.update(temperature=temperature, top_p=float(body.get("top_p", 1.0)), top_k=0)
        else:
            gen_kwargs.update(temperature=None, top_p=None, top_k=None)
        if body.get("ignore_eos"):
            gen_kwargs["min_new_tokens"] = max_tokens
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

        async def run():
            """Yields ``(text, n_tokens)`` items while holding the lock."""
            async with lock:
                streamer, cancel = TokenStreamer(tokenizer), threading.Event()
                kwargs = {**gen_kwargs, "streamer": streamer, "stopping_criteria": [Cancelled(cancel)]}
                thread = threading.Thread(target=lambda: torch.inference_mode()(model.generate)(**kwargs), daemon=True)
                thread.start()
                loop = asyncio.get_running_loop()
                try:
                    stop = streamer.stop_signal
                    while (item := await loop.run_in_executor(None, streamer.text_queue.get)) is not stop:
                        yield item
                finally:
                    cancel.set()
                    await loop.run_in_executor(None, thread.join)

        def finish_reason(n: int) -> str:
            return "length" if n >= max_tokens else "stop"

        usage = lambda n: {"prompt_tokens": ids.shape[1], "completion_tokens": n, "total_tokens": ids.shape[1] + n}  # noqa: E731
        if not body.get("stream"):
            parts, n = [], 0
            async for text, k in run():
                parts.append(text)
                n += k
            return JSONResponse({**chunk("".join(parts), finish_reason(n)), "usage": usage(n)})

        async def events():
            n = 0
            async for text, k in run():
                n += k
                yield _sse(chunk(text, None))
            yield _sse(chunk("", finish_reason(n)))
            if include_usage:
                yield _sse({**chunk("", None), "choices": [], "usage": usage(n)})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="HF-format model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    app = create_app(args.model, args.dtype, args.served_model_name, args.device)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
