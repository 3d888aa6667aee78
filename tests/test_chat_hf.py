"""Chat through a Hugging Face folder's chat template (issue 42's acceptance): a chat request to a Llama folder
with a template in its tokenizer_config.json gives the same tokens as transformers' apply_chat_template(...,
add_generation_prompt=True) and greedy generate. transformers is the oracle: its own rendering (the template's
text, then its tokenizer) and its own model.
"""
import json
import os

import pytest

pytest.importorskip("safetensors", reason="safetensors not installed (pip install -e '.[hf]')")
pytest.importorskip("tokenizers", reason="tokenizers not installed (pip install tokenizers)")
pytest.importorskip("jinja2", reason="jinja2 not installed (pip install -e '.[hf]')")
from serving import Server  # noqa: E402
from test_hf import needs_mpiexec, needs_oracle, transformers_folder  # noqa: E402
from test_hf_text import V, bpe  # noqa: E402

from mpi_tp.text.chat import ChatError, folder_chat_template  # noqa: E402

# whitespace that only trim_blocks and lstrip_blocks remove, a raise_exception, the bos token, tojson
TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('roles are system, user and assistant') }}
    {% endif %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>{{ 'ok' | tojson }}
{% endif %}"""
CHATS = [[{"role": "user", "content": "The cat"}],
         [{"role": "system", "content": "Café "}, {"role": "user", "content": "def f(x):"}]]


def chat_folder(path):
    """Rank 0: a random LlamaForCausalLM (64 positions) with the BPE tokenizer and the template; transformers'
    tokenizer of it."""
    from transformers import AutoTokenizer
    model = transformers_folder(path, seed=5, arch="llama", vocab_size=V, max_position_embeddings=64)
    bpe(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                   "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}, f)
    return model, AutoTokenizer.from_pretrained(path)


@needs_oracle
def test_the_template_renders_as_transformers_renders_it(tmp_path):
    _, tok = chat_folder(str(tmp_path / "llama"))
    template = folder_chat_template(str(tmp_path / "llama"))
    for chat in CHATS:
        assert template.render(chat) == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    with pytest.raises(ChatError, match="roles are system, user and assistant"):
        template.render([{"role": "tool", "content": "x"}])


@needs_oracle
@needs_mpiexec
def test_a_chat_request_gives_transformers_tokens(tmp_path):
    import torch
    folder = str(tmp_path / "llama")
    model, tok = chat_folder(folder)
    want = []
    for chat in CHATS:
        ids = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
        p = torch.tensor([ids])
        out = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=8, do_sample=False,
                             pad_token_id=0)[0, len(ids):].tolist()
        want.append((ids, out))
    s = Server(folder, tmp_path, "--max-batch", "2")
    try:
        for chat, (ids, out) in zip(CHATS, want):
            status, got = s.call("/v1/chat/completions", {"model": "llama", "messages": chat, "max_tokens": 8,
                                                          "temperature": 0, "return_token_ids": True})
            assert status == 200, got
            choice = got["choices"][0]
            assert choice["prompt_token_ids"] == ids and choice["token_ids"] == out, (choice, ids, out)
            assert choice["message"]["content"] == tok.decode(out) and got["usage"]["prompt_tokens"] == len(ids)
    finally:
        assert s.stop() == 0
