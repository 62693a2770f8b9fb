"""The commands of `edgellm chat`: a line that starts with "/" is one of them, never a prompt
(a line that starts with "//" is sent with one "/")."""
from __future__ import annotations

import json
import sys
from typing import Callable

HELP = """commands:
  /help            this list
  /system TEXT     set the system prompt (empty: none)
  /reset           forget the conversation (the system prompt stays)
  /save FILE       save the conversation and its KV to FILE
  /load FILE       continue a conversation /save wrote (its KV: no prompt to compute again)
  /stats           the last answer's speed
  /exit, /quit     leave (Ctrl-D too)
a line starting with // is sent as a message starting with /"""


class Conversation:
    def __init__(self, model, system: str | None = None, stats: Callable[[object], str] = str):
        """`stats`: an answer's statistics line (generate.py's, which runs the chat)."""
        self.model, self.ended, self.last, self.stats = model, False, None, stats
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.commands: dict[str, Callable[[str], None]] = {
            "/help": lambda _: _say(HELP), "/system": self._system, "/reset": self._reset, "/save": self._save,
            "/load": self._load, "/stats": self._stats, "/exit": self._exit, "/quit": self._exit}

    def command(self, line: str) -> bool:
        """Run `line` if it is a command (True), else leave it to be sent (False)."""
        text = line.strip()
        if not text.startswith("/") or text.startswith("//"):
            return False
        name, _, rest = text.partition(" ")
        run = self.commands.get(name)
        if run is None:
            _say(f"unknown command {name}; /help lists them")
            return True
        try:
            run(rest.strip())
        except Exception as error:  # noqa: BLE001 - a failed command keeps the chat going
            _say(f"{name}: {error}")
        return True

    def answered(self, done) -> None:
        self.messages.append({"role": "assistant", "content": done.text})
        self.last = done

    def _system(self, text: str) -> None:
        self.messages = [m for m in self.messages if m["role"] != "system"]
        if text:
            self.messages.insert(0, {"role": "system", "content": text})
        _say("system prompt " + ("set" if text else "cleared"))

    def _reset(self, _: str) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
        _say("conversation cleared")

    def _save(self, path: str) -> None:
        if not path:
            raise ValueError("give a file: /save FILE")
        if not any(m["role"] != "system" for m in self.messages):
            raise ValueError("nothing to save yet")
        tokens = self.model.save_prefix(self.messages, path, note=json.dumps(self.messages))
        _say(f"saved {len(self.messages)} messages and the KV of {tokens} tokens to {path}")

    def _load(self, path: str) -> None:
        from edgellm.kv.persist import saved_note

        if not path:
            raise ValueError("give a file: /load FILE")
        tokens = self.model.load_prefix(path)
        messages = json.loads(saved_note(path) or "null")
        if not isinstance(messages, list):
            raise ValueError(f"{path} holds no conversation")
        self.messages = messages
        _say(f"loaded {len(messages)} messages and the KV of {tokens} tokens")

    def _stats(self, _: str) -> None:
        _say(self.stats(self.last) if self.last is not None else "no answer yet")

    def _exit(self, _: str) -> None:
        self.ended = True


def _say(text: str) -> None:
    print(text, file=sys.stderr)
