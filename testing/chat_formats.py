"""Tiny model folders that speak the families' chat formats: the demo model's ``tiny`` size with the
families' marker tokens added to its tokenizer (``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` as Qwen's plain added tokens, ``<|python_tag|>`` and ``[TOOL_CALLS]`` as special ones, as
in Llama's and Mistral's tokenizers) and its embeddings grown to match, with a Qwen3-, Llama 3.1- or
Mistral-like chat template.

The weights are random, so what the model writes is noise; tests hold its shape with grammars. The
``</think>`` row of the output layer is scaled up so that a reasoning section, which is free text, ends
within a few tokens under greedy decoding rather than at max_tokens.

The Qwen3 template takes one variable of ours besides ``enable_thinking``: ``open_thinking`` ends the
generation prompt with ``<think>\\n`` (as DeepSeek-R1's and Qwen3-Thinking-2507's templates do), so the
output starts inside the section.
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN_MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
SPECIAL_MARKERS = ["<|python_tag|>", "[TOOL_CALLS]"]
END_THINK_SCALE = 6.0  # the </think> output row's scale (see the module's docstring)

# Written for transformers' renderer (trim_blocks: a newline right after a tag is dropped, so those are
# written as {{ '\n' }}); no whitespace control, so every newline of the prompt is where it shows.
QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% set content = m.content or '' %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ content }}"
    "{% for tc in m.tool_calls or [] %}{{ '\\n' }}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_thinking is defined and open_thinking %}<think>\n{% endif %}{% endif %}"
)

LLAMA31_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for tc in m.tool_calls %}<|python_tag|>{\"name\": \"{{ tc.function.name }}\", \"parameters\": "
    "{{ tc.function.arguments | tojson }}}{% endfor %}<|eom_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ '\\n\\n' }}"
    "{% if tools and loop.last and m.role == 'user' %}Given the following functions, please respond with "
    "a JSON for a function call with its proper arguments that best answers the given prompt.\n\n"
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}. Do not use variables.\n\n{% for t in tools %}{{ t | tojson }}{{ '\\n\\n' }}{% endfor %}{% endif %}"
    "{{ m.content }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}"
)

MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS][{% for tc in m.tool_calls %}"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{% else %}{{ m.content }}{% endif %}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}"
)

TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "llama3_1": LLAMA31_TEMPLATE, "mistral": MISTRAL_TEMPLATE}


def add_marker_tokens(model_dir: Path) -> None:
    """The families' markers added to the folder's tokenizer.json (the ids after its vocabulary)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in QWEN_MARKERS])
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in SPECIAL_MARKERS])
    tok.save(str(model_dir / "tokenizer.json"))


def build_chat_format_model(model_dir: Path) -> Path:
    """The demo ``tiny`` model with every marker token (one folder serves all templates: write one with
    ``set_template``)."""
    import torch
    from transformers import AutoModelForCausalLM
    from tokenizers import Tokenizer

    from llmbus.supervisor.demo_model import build_demo_model

    model_dir = Path(model_dir)
    build_demo_model(model_dir, "tiny")
    add_marker_tokens(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.resize_token_embeddings(tok.get_vocab_size(with_added_tokens=True), mean_resizing=False)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            rows = layer.weight[-(len(QWEN_MARKERS) + len(SPECIAL_MARKERS)):]
            rows.copy_(torch.randn(rows.shape, generator=generator) * 0.5)
        model.get_output_embeddings().weight[tok.token_to_id("</think>")] *= END_THINK_SCALE
    model.save_pretrained(model_dir)
    return model_dir


def set_template(model_dir: Path, family: str) -> Path:
    """Write ``TEMPLATES[family]`` as the folder's chat template."""
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = TEMPLATES[family]
    path.write_text(json.dumps(config))
    return Path(model_dir)


def marker_vocabulary(tokenizer_json: Path, folder: Path):
    """(tokenizers.Tokenizer, llguidance.LLTokenizer, {added token text: id}) of ``tokenizer_json`` with the
    marker tokens added (written into ``folder``): the grammar tests' vocabulary."""
    import shutil

    import llguidance
    from tokenizers import Tokenizer

    shutil.copy(tokenizer_json, Path(folder) / "tokenizer.json")
    add_marker_tokens(Path(folder))
    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    return tok, llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size()), added


def grammar_accepts(llg_tokenizer, grammar, ids: list[int]) -> bool:
    """Whether a wire ``Grammar`` takes exactly these tokens (every one, and then may end)."""
    import llguidance

    from llmbus.bus.grammar import llguidance_grammar

    matcher = llguidance.LLMatcher(llg_tokenizer, llguidance_grammar(grammar), log_level=0)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


# --- harmony (gpt-oss) ----------------------------------------------------------------------------------

HARMONY_MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
HARMONY_ENDS = ["<|return|>", "<|call|>"]  # its end-of-sequence tokens (gpt-oss's generation_config)

# A gpt-oss-like template, written for these tests: a system message with the reasoning effort, the developer
# message with the instructions and the functions (as one JSON line each, where gpt-oss writes TypeScript),
# past turns' answers on the final channel, calls on commentary with the recipient before the channel (the
# history form), results from functions.NAME, and a generation prompt that opens an assistant message.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are a tiny test model.\n"
    "Reasoning: {{ reasoning_effort if reasoning_effort is defined else 'medium' }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% set rest = messages %}"
    "{% if messages and messages[0].role in ('system', 'developer') %}{% set rest = messages[1:] %}{% endif %}"
    "{% if rest is not sameas messages or tools %}<|start|>developer<|message|>"
    "{% if rest is not sameas messages %}# Instructions\n\n{{ messages[0].content }}\n\n{% endif %}"
    "{% if tools %}# Tools\n\nnamespace functions {\n"
    "{% for tool in tools %}{{ tool.function.name }}: {{ tool.function.parameters | tojson }}\n{% endfor %}"
    "} // namespace functions{% endif %}<|end|>{% endif %}"
    "{% set last = namespace(call='') %}{% for m in rest %}"
    "{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% set call = m.tool_calls[0].function %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>{% set last.call = call.name %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ last.call }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def build_harmony_model(model_dir: Path) -> Path:
    """The demo ``tiny`` model speaking harmony: its markers added as special tokens, <|return|> and <|call|> its
    end-of-sequence ids, the harmony template. The weights are noise; tests hold its answers with grammars, and
    the <|end|> row of the output layer is scaled up so that an analysis message ends within a few tokens."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoModelForCausalLM

    from llmbus.supervisor.demo_model import build_demo_model

    model_dir = Path(model_dir)
    build_demo_model(model_dir, "tiny")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in HARMONY_MARKERS])
    tok.save(str(model_dir / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.resize_token_embeddings(tok.get_vocab_size(with_added_tokens=True), mean_resizing=False)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            rows = layer.weight[-len(HARMONY_MARKERS):]
            rows.copy_(torch.randn(rows.shape, generator=generator) * 0.5)
        # an analysis message, free text, ends within a few tokens (as </think> in build_chat_format_model)
        model.get_output_embeddings().weight[tok.token_to_id("<|end|>")] *= END_THINK_SCALE
    model.save_pretrained(model_dir)
    ends = [tok.token_to_id(m) for m in HARMONY_ENDS]
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": ends}))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": HARMONY_TEMPLATE, "eos_token": "<|return|>"}))
    return model_dir
