"""A complete OpenAI Batch API client run against `moecc serve` (issue 34): the same code an
OpenAI pipeline runs, with `base_url` pointed at this machine.

    moecc serve examples/demo-model --data-dir serve-data &
    python examples/batch_client.py                      # writes batch-results.jsonl
    python examples/batch_client.py --input my.jsonl --base-url http://127.0.0.1:8000/v1 --api-key KEY

Without --input it writes a small chat batch for the first model the server lists. It
uploads the file (purpose "batch"), creates the batch, polls it (printing its status and
request counts), then downloads the output and error files, prints each answer and writes
them to --output (and the errors beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from openai import OpenAI

TOPICS = ["the for statement", "a class definition", "the with statement", "exceptions", "list comprehensions",
          "the import system"]
DONE = ("completed", "failed", "expired", "cancelled")


def sample_batch(path: Path, model: str) -> Path:
    """A chat batch file of one request per topic, for `model`."""
    lines = [{"custom_id": f"topic-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": f"Tell me about {t}."}],
                       "max_tokens": 32}} for i, t in enumerate(TOPICS)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def run(client: OpenAI, input_path: Path, endpoint: str, output: Path, poll_s: float) -> int:
    """Upload, create, poll, download; the exit status (0: every request succeeded)."""
    with open(input_path, "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    print(f"uploaded {input_path} as {uploaded.id} ({uploaded.bytes} bytes)")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h",
                                  metadata={"source": input_path.name})
    print(f"created {batch.id}")
    while batch.status not in DONE:
        time.sleep(poll_s)
        batch = client.batches.retrieve(batch.id)
        c = batch.request_counts
        print(f"  {batch.status}: {c.completed if c else 0} done, {c.failed if c else 0} failed "
              f"of {c.total if c else '?'}")
    if batch.status == "failed":
        for e in (batch.errors.data if batch.errors and batch.errors.data else []):
            print(f"batch failed: line {e.line}: {e.code}: {e.message}", file=sys.stderr)
        return 1
    if batch.output_file_id:
        text = client.files.content(batch.output_file_id).text
        output.write_text(text, encoding="utf-8")
        for line in text.splitlines():
            rec = json.loads(line)
            body = rec["response"]["body"]
            answer = body["choices"][0].get("message", {}).get("content") or body["choices"][0].get("text")
            print(f"{rec['custom_id']}: {answer!r}")
        print(f"wrote {output}")
    if batch.error_file_id:
        errors = output.with_name(output.stem + ".errors.jsonl")
        errors.write_text(client.files.content(batch.error_file_id).text, encoding="utf-8")
        print(f"wrote {errors} ({batch.request_counts.failed} failed requests)")
    return 0 if batch.status == "completed" and not batch.request_counts.failed else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"),
                    help="the key given to moecc serve --api-key (any string when it has none)")
    ap.add_argument("--input", type=Path, help="a Batch API JSONL file (default: a sample chat batch)")
    ap.add_argument("--endpoint", default="/v1/chat/completions", choices=["/v1/chat/completions", "/v1/completions"])
    ap.add_argument("--output", type=Path, default=Path("batch-results.jsonl"))
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between status polls")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    input_path = args.input
    if input_path is None:
        model = client.models.list().data[0].id
        input_path = sample_batch(args.output.with_name("batch-input.jsonl"), model)
        print(f"wrote a sample batch for model {model} to {input_path}")
    return run(client, input_path, args.endpoint, args.output, args.poll)


if __name__ == "__main__":
    sys.exit(main())
