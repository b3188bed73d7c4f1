"""vLLM's /tokenize, /detokenize and /tokenizer_info: the server's own tokenizer and chat template, so a client
counts and builds prompts with exactly the ids the engine will see (lm-evaluation-harness's "remote" tokenizer
reads these three)."""

from __future__ import annotations

from serving import protocol as p
from serving.errors import APIError
from serving.handlers import template_kwargs
from tunix_rt.tools.chat import message_text, render_chat
from tunix_rt.tools.tool_calls import check_tools


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _chat_text(state, req: p.TokenizeRequest) -> str:
    if req.continue_final_message and req.add_generation_prompt:
        raise _bad("continue_final_message and add_generation_prompt cannot both be true", "continue_final_message")
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    try:
        check_tools(tools or [])
    except ValueError as e:
        raise _bad(str(e), "tools") from None
    try:
        text = render_chat(state.tokenizer, messages, state.tool_format, tools,
                           add_generation_prompt=req.add_generation_prompt,
                           template_kwargs=template_kwargs(req.chat_template_kwargs))
        content = message_text(messages[-1], len(messages) - 1) if messages else ""
    except ValueError as e:
        raise _bad(str(e), "messages") from None
    if req.continue_final_message:  # the last message stays open: the text ends where its content does
        end = text.rfind(content) if content else -1
        if end < 0:
            raise _bad("continue_final_message needs a final message with text content the chat template renders "
                       "as given", "messages")
        text = text[:end + len(content)]
    return text


def tokenize(state, req: p.TokenizeRequest) -> p.TokenizeResponse:
    if req.prompt is not None:
        ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        ids = state.tokenizer.encode(_chat_text(state, req), add_special_tokens=bool(req.add_special_tokens))
    strs = [state.tokenizer.backend.id_to_token(i) for i in ids] if req.return_token_strs else None
    return p.TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


def detokenize(state, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
    vocab = state.tokenizer.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise _bad(f"tokens[{bad}] is {req.tokens[bad]}, outside the vocabulary [0, {vocab})", "tokens")
    return p.DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens, skip_special_tokens=False))


def tokenizer_info(state) -> p.TokenizerInfo:
    tok = state.tokenizer
    return p.TokenizerInfo(bos_token=tok.bos_token, eos_token=tok.eos_token, pad_token=tok.pad_token,
                           chat_template=tok.chat_template, model_max_length=state.max_model_len,
                           vocab_size=tok.vocab_size, add_bos_token=tok.add_bos_token)
