"""The call tree on its own: exact reuse, drift, retries, forks — with the tiny tokenizer, no server."""

from __future__ import annotations

from gyre.model.tokenizer import build_tokenizer
from gyre.proxy.conversation import Conversation, Message
from gyre.proxy.render import ChatMLRenderer
from gyre.proxy.tito import CallRecord, CallTree
from gyre.proxy.tokens import TokenCodec

CODEC = TokenCodec(build_tokenizer())
RENDER = ChatMLRenderer()
EOS = 258


def _conv(*turns: tuple[str, str]) -> Conversation:
    return Conversation((Message("system", "sys"), *(Message(r, t) for r, t in turns)))  # type: ignore[arg-type]


def _call(tree: CallTree, conv: Conversation, name: str, output: list[int], shown: str | None = None) -> CallRecord:
    """Plan + start + finish one call; `shown` is the reply text the harness got (default: the decoded output
    without a final end-of-turn)."""
    plan = tree.plan(RENDER.units(conv))
    record = tree.start(plan, name)
    expected = (plan.parent.ids(0, plan.prefix_len).tolist() if plan.parent else []) + plan.delta.tolist()
    assert record.ids().tolist() == expected
    if shown is None:
        shown = CODEC.decode(output[:-1] if output and output[-1] == EOS else output)
    tree.finish(record, output, RENDER.assistant_body(Message("assistant", shown)))
    return record


def _prompt(record: CallRecord) -> list[int]:
    return record.ids(0, record.prompt_len).tolist()


def test_clean_chain_reuses_exact_output_ids() -> None:
    tree = CallTree(CODEC)
    spelled = [ord(c) for c in "<tool_call>"] + [EOS]  # not how the tokenizer would encode that text
    first = _call(tree, _conv(("user", "hi")), "c1", spelled)
    assert first.parent is None and first.prefix_len == 0
    second_conv = _conv(("user", "hi"), ("assistant", "<tool_call>"), ("user", "next"))
    second = _call(tree, second_conv, "c2", [ord("o"), ord("k"), EOS])
    assert second.parent is first and second.prefix_len == first.full_len
    assert _prompt(second)[: first.full_len] == first.ids().tolist()
    assert _prompt(second)[first.full_len :] == CODEC.encode(
        "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"
    )
    assert 259 not in _prompt(second)  # the model's byte spelling survived; a re-encode would give <tool_call>


def test_max_tokens_and_edited_echo() -> None:
    tree = CallTree(CODEC)
    cut = _call(tree, _conv(("user", "a")), "c1", CODEC.encode("abc"))  # no end-of-turn: cut by max_tokens
    child = _call(tree, _conv(("user", "a"), ("assistant", "abc"), ("user", "b")), "c2", [*CODEC.encode("x "), EOS])
    assert child.parent is cut and child.prefix_len == cut.full_len
    assert child.delta.tolist()[0] == EOS  # the end-of-turn the template adds after a cut reply
    # The harness strips the trailing space of the echoed reply: 2 of c2's 3 output tokens are reused.
    plan = tree.plan(
        RENDER.units(_conv(("user", "a"), ("assistant", "abc"), ("user", "b"), ("assistant", "x"), ("user", "c")))
    )
    assert plan.parent is child and plan.prefix_len == child.prompt_len + 1 and plan.drift == 2
    assert plan.delta.tolist()[:1] == [EOS]


def test_retry_and_edit_are_siblings_a_new_task_is_a_root() -> None:
    tree = CallTree(CODEC)
    c1 = _call(tree, _conv(("user", "task")), "c1", [*CODEC.encode("A"), EOS])
    conv2 = _conv(("user", "task"), ("assistant", "A"), ("user", "result"))
    c2 = _call(tree, conv2, "c2", [*CODEC.encode("B"), EOS])
    retry = _call(tree, conv2, "c3", [*CODEC.encode("C"), EOS])
    assert c2.parent is c1 and retry.parent is c1 and retry.delta.tolist() == c2.delta.tolist()
    edited = _conv(("user", "task"), ("assistant", "A"), ("user", "result (edited)"))
    sibling = _call(tree, edited, "c4", [*CODEC.encode("D"), EOS])  # still extends c1's prompt + output
    assert sibling.parent is c1 and sibling.prefix_len == c1.full_len
    root = _call(tree, _conv(("user", "task"), ("user", "more")), "c5", [EOS])  # extends no call's output
    assert root.parent is None and root.prefix_len == 0
    shared = c1.prompt_len - len(CODEC.encode("\n<|im_start|>assistant\n"))
    assert _prompt(root)[:shared] == _prompt(c1)[:shared]
    third = _conv(("user", "task"), ("assistant", "A"), ("user", "result"), ("assistant", "C"), ("user", "go"))
    assert tree.plan(RENDER.units(third)).parent is retry


def test_planning_is_read_only_and_harness_turns_are_context() -> None:
    tree = CallTree(CODEC)
    conv = _conv(("user", "u"), ("assistant", "written by the harness"), ("user", "v"))
    before = tree.plan(RENDER.units(conv))
    assert before.parent is None and tree.plan(RENDER.units(conv)).delta == before.delta
    record = _call(tree, conv, "c1", [EOS])
    assert record.parent is None and record.delta.tolist() == CODEC.encode("".join(u.text for u in RENDER.units(conv)))


def test_prompt_json_reuses_a_drifted_ancestors_cached_prefix() -> None:
    """`prompt_of` sends exactly the recorded prompt ids, and caches the JSON of the prefix a child reuses
    even when that is not all of the ancestor's tokens (its echoed turn drifted), so later calls do not
    serialise it again."""
    import json

    from gyre.engine.client import ids_json
    from gyre.proxy.transport import prompt_of

    tree = CallTree(CODEC)
    first = _call(tree, _conv(("user", "a")), "c1", [*CODEC.encode("x "), EOS], shown="x")  # echo drops the space
    turns: list[tuple[str, str]] = [("user", "a"), ("assistant", "x"), ("user", "b")]
    second = _call(tree, _conv(*turns), "c2", [*CODEC.encode("y"), EOS])
    assert second.parent is first and second.prefix_len < first.full_len  # a drifted prefix
    third = _call(tree, _conv(*turns, ("assistant", "y"), ("user", "c")), "c3", [*CODEC.encode("z"), EOS])
    for record in (second, third):
        prompt = prompt_of(record)
        assert json.loads(prompt.json()) == _prompt(record) and prompt.length == record.prompt_len
    assert first.wire == (second.prefix_len, ids_json(first.ids(0, second.prefix_len)))


def test_a_calls_prompt_json_is_kept_when_sent_and_extended_by_its_output() -> None:
    """The JSON of a call's own prompt, serialised when it is sent (before it finishes), is kept and only
    its output's is added when its child reuses it; every prompt is still exactly the recorded ids."""
    import json

    from gyre.engine.client import ids_json
    from gyre.proxy.transport import prompt_of

    tree = CallTree(CODEC)
    turns: list[tuple[str, str]] = [("user", "a")]
    parent = None
    for i in range(3):
        record = tree.start(tree.plan(RENDER.units(_conv(*turns))), f"c{i}")
        assert record.parent is parent
        for extra in ((), [7, 8]):  # a continued call sends its partial output too
            prompt = prompt_of(record, extra)
            assert json.loads(prompt.json()) == [*record.ids().tolist(), *extra]
        assert record.wire == (record.prompt_len - record.prefix_len, ids_json(record.delta))
        output = [*CODEC.encode(f"r{i}"), EOS]
        tree.finish(record, output, RENDER.assistant_body(Message("assistant", f"r{i}")))
        turns += [("assistant", f"r{i}"), ("user", f"q{i}")]
        parent = record
    assert parent is not None and parent.parent is not None
    grand = parent.parent
    reused = parent.prefix_len - grand.prefix_len  # the grandparent's tokens its child reused, kept as sent
    assert grand.wire == (reused, ids_json(grand.tokens[:reused]))
