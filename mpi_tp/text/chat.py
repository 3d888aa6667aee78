"""A model's chat template: the Jinja text a Hugging Face folder keeps that turns chat messages into the
prompt the model was tuned on (what `mpi-tp serve`'s /v1/chat/completions sends the model).

    template = folder_chat_template("llama-folder")   # None: the folder has none
    template.render([{"role": "user", "content": "Hi"}])   # the prompt text, ending where the answer begins

The template is rendered as transformers' apply_chat_template(..., add_generation_prompt=True) renders it:
jinja2's sandbox (a template cannot reach Python's internals), trim_blocks and lstrip_blocks, the loop
controls, `raise_exception(message)` (a template refusing the messages: that message, to the client),
`tojson` that keeps non-ASCII text, `strftime_now(format)`, and the folder's special tokens (bos_token,
eos_token, unk_token, pad_token) as variables. The text is then tokenized as it is (the template writes
the bos token itself): HFTokenizer.encode adds no special tokens.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

from mpi_tp.core.errors import UserError

ROLES = ("system", "user", "assistant", "tool", "developer")
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatError(UserError, ValueError):
    """Messages the template cannot render, or a template that cannot be loaded; the message says why."""


class ChatTemplate:
    """A Jinja chat template and the special tokens it may name (source: where it came from, for messages)."""

    def __init__(self, text: str, special: dict | None = None, source: str = "the chat template"):
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ChatError("a chat template needs jinja2: pip install jinja2 (or mpi_tp[hf])") from None

        def raise_exception(message):
            raise ChatError(f"the chat template refused these messages: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.jinja2, self.source, self.special = jinja2, source, dict(special or {})
        try:
            self.template = env.from_string(text)
        except jinja2.TemplateError as e:
            raise ChatError(f"{source} is not a Jinja template jinja2 reads ({e})") from None

    def render(self, messages) -> str:
        """The prompt text of these OpenAI-style messages (each {"role": ..., "content": text, or a list of
        {"type": "text", "text": ...} parts, joined}), ending with the generation prompt."""
        checked = [self._message(i, m) for i, m in enumerate(messages if isinstance(messages, list) else [None])]
        if not checked:
            raise ChatError("messages must hold at least one message")
        try:
            return self.template.render(messages=checked, tools=None, documents=None, add_generation_prompt=True,
                                        **self.special)
        except ChatError:
            raise
        except self.jinja2.TemplateError as e:   # the sandbox's refusals too (SecurityError is one)
            raise ChatError(f"the chat template failed on these messages ({type(e).__name__}: {e})") from None
        except Exception as e:  # noqa: BLE001 (a template's own error: this request's, said to the client)
            raise ChatError(f"the chat template failed on these messages ({type(e).__name__}: {e})") from None

    @staticmethod
    def _message(i: int, m) -> dict:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise ChatError(f"messages[{i}] must be an object with a role ({', '.join(ROLES)}) and a content, "
                            f"not {json.dumps(m)[:60]}")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ChatError(f"messages[{i}].content must be text (or a list of text parts), not "
                            f"{json.dumps(content)[:60]}")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise ChatError(f"messages[{i}] has field(s) this server does not support: {', '.join(unknown)}")
        return {**m, "content": content}


def _token(x) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or an AddedToken's {"content": text, ...}."""
    return x.get("content") if isinstance(x, dict) else x if isinstance(x, str) else None


def _config(folder: str) -> dict:
    path = os.path.join(folder, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ChatError(f"{path} cannot be read as JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def special_tokens(folder: str) -> dict:
    """The special tokens a folder's tokenizer_config.json names (bos_token, ...: what templates write)."""
    config = _config(folder)
    return {k: t for k in SPECIAL if (t := _token(config.get(k))) is not None}


def folder_chat_template(folder: str) -> ChatTemplate | None:
    """A Hugging Face folder's chat template (chat_template.jinja, or tokenizer_config.json's chat_template:
    a text, or named templates of which "default"), with its special tokens; None if it has none."""
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        return template_file(jinja_path, special_tokens(folder))
    text = _config(folder).get("chat_template")
    if isinstance(text, list):                   # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    if text is None:
        return None
    where = os.path.join(folder, "tokenizer_config.json")
    if not isinstance(text, str):
        raise ChatError(f"{where}'s chat_template must be a text (or named templates with a 'default')")
    return ChatTemplate(text, special_tokens(folder), f"{where}'s chat_template")


def template_file(path: str, special: dict | None = None) -> ChatTemplate:
    """A chat template from a file of Jinja text (--chat-template)."""
    try:
        with open(path, encoding="utf-8") as f:
            return ChatTemplate(f.read(), special, path)
    except (OSError, UnicodeDecodeError) as e:
        raise ChatError(f"cannot read the chat template {path} ({e})") from None
