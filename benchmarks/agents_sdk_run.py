"""The OpenAI Agents SDK's default model (its Responses API model) running an agent with a function tool against
`tunix-rt serve`, streamed and not.

The SDK lives in its own environment (it pins its own openai client):

    python3 -m venv /tmp/agents && /tmp/agents/bin/pip install openai-agents
    python benchmarks/agents_sdk_run.py --agents-python /tmp/agents/bin/python

This script starts the server on the default model and runs benchmarks/agents_sdk_agent.py under that Python.
The agent must call `get_weather` (tool_choice "required" on its first turn; the SDK resets it to "auto" after
the call), get the tool's result, and finish with a text answer. It prints each run's tool calls, final output,
turns and time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import server_process

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents-python", required=True, help="a Python with openai-agents installed")
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    proc, base = server_process.start(["--model", args.model, "--max-model-len", "2048"], log_prefix="agents-sdk-")
    try:
        return subprocess.run([args.agents_python, os.path.join(HERE, "agents_sdk_agent.py"), f"{base}/v1",
                               args.model]).returncode
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
