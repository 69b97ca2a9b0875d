"""The DeepSeek V4 chat template (chat mode), rendered to token ids.

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{reply}<｜end▁of▁sentence｜><｜User｜>…<｜Assistant｜></think>

That is the released V4 encoding in its non-thinking "chat" mode: system text follows BOS bare,
each user turn opens with <｜User｜>, the turn the model answers opens with <｜Assistant｜> and
an already-closed </think>, and a past assistant reply ends with EOS. Tools, reasoning replay
and thinking mode are not served here.

The template yields (special, text) parts and the tokenizer encodes them separately: turn
markers become their special ids, and message content is encoded as plain text, so a message
that contains "<｜User｜>" cannot forge a turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from runtime.model.tokenizer import ASSISTANT_TOKEN, BOS_TOKEN, EOS_TOKEN, THINK_END, USER_TOKEN

ROLES = ("system", "user", "assistant")


def render(messages: Sequence[tuple[str, str]]) -> list[tuple[bool, str]]:
    """Parts of the prompt for (role, content) messages: (is_special, text) in order.

    The caller has checked roles (one of ROLES) and that the last message is not the
    assistant's; this only lays out the turns.
    """
    parts: list[tuple[bool, str]] = [(True, BOS_TOKEN)]
    for i, (role, content) in enumerate(messages):
        if role == "user":
            parts.append((True, USER_TOKEN))
        if content:
            parts.append((False, content))
        if role == "assistant":
            parts.append((True, EOS_TOKEN))
        following = messages[i + 1][0] if i + 1 < len(messages) else None
        # a user turn, or a system prompt that ends the list or precedes a reply, opens the answer
        if role != "assistant" and following in (None, "assistant"):
            parts.append((True, ASSISTANT_TOKEN))
            parts.append((True, THINK_END))
    return parts


def encode(tokenizer, parts: list[tuple[bool, str]]) -> list[int]:
    """Token ids of rendered parts: specials by id (or as text where the tokenizer has none)."""
    ids: list[int] = []
    for special, text in parts:
        sid = tokenizer.special_id(text) if special else None
        if sid is not None:
            ids.append(sid)
        else:
            ids.extend(tokenizer.encode_plain(text))
    return ids


def prompt_text(parts: list[tuple[bool, str]]) -> str:
    """The rendered prompt as one string (what `encode` tokenizes), for logs and tests."""
    return "".join(text for _, text in parts)
