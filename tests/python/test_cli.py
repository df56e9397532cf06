"""Black-box tests of the `tandem` CLI beside the HTTP server."""

import os
import subprocess

from conftest import MODEL_NAME, ROOT, TANDEM_BIN


def test_chat_local_answers_like_the_server(client):
    """`tandem chat --local` serves the model in process and answers exactly as `tandem serve` does (greedy)."""
    question = "What is the capital of France?"
    expected = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": question}],
        max_tokens=16,
        temperature=0,
    ).choices[0].message.content
    args = [TANDEM_BIN, "chat", "--local", "--temperature", "0", "--max-tokens", "16", "--kv-cache-memory", "64MiB"]
    if os.environ.get("TANDEM_MODEL"):
        args += ["--model-path", os.environ["TANDEM_MODEL"]]
    done = subprocess.run(
        args, cwd=ROOT, input=f"{question}\n/reset\n/exit\n", capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "in this process" in done.stderr
    # Piped lines are echoed after the prompt, and /reset says what it did.
    assert f"> {question}\n" in done.stderr, done.stderr
    assert "> /reset\n(conversation forgotten" in done.stderr, done.stderr
    assert done.stdout.strip() == expected.strip()


def test_chat_model_path_requires_local():
    done = subprocess.run(
        [TANDEM_BIN, "chat", "--model-path", "x.gguf"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "--local" in done.stderr
