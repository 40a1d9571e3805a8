import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_assets.lib.generation.conversations import (
    Conversation,
    ConversationError,
    batch_key,
    batch_slice,
    load_conversations,
    num_batches,
    parse_batch_key,
    prompt_id_for,
)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_messages_jsonl_drops_the_final_assistant_turn_and_keeps_ids(tmp_path):
    path = write_jsonl(
        tmp_path / "pool.jsonl",
        [
            {"prompt_id": "a", "messages": [user("hi")]},
            {"id": 7, "messages": [user("q1"), assistant("a1"), user("q2"), assistant("a2")]},
            {"messages": [{"role": "system", "content": "be brief"}, user("q"), assistant("a")]},
        ],
    )
    pool = load_conversations(path)
    assert [c.prompt_id for c in pool[:2]] == ["a", "7"]
    assert pool[0].messages == [user("hi")]
    assert pool[1].messages == [user("q1"), assistant("a1"), user("q2")]
    expected = [{"role": "system", "content": "be brief"}, user("q")]
    assert pool[2] == Conversation(prompt_id_for(expected), expected)


def test_hash_ids_are_the_content_hash_whatever_the_key_order():
    messages = [user("Tell me about the 'if' statement.")]
    payload = '[{"content": "Tell me about the \'if\' statement.", "role": "user"}]'
    assert prompt_id_for(messages) == hashlib.sha256(payload.encode()).hexdigest()[:12]
    assert prompt_id_for([{"content": messages[0]["content"], "role": "user"}]) == (
        prompt_id_for(messages)
    )


def test_an_empty_pool_is_refused_by_name(tmp_path):
    empty = tmp_path / "pool.jsonl"
    empty.write_text("")
    with pytest.raises(ConversationError, match=r"pool\.jsonl: no conversations"):
        load_conversations(empty)


def test_sharegpt_jsonl_and_json_array(tmp_path):
    record = {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "hello"},
            {"from": "gpt", "value": "hi there"},
        ]
    }
    expected = [{"role": "system", "content": "sys"}, user("hello")]
    from_jsonl = load_conversations(write_jsonl(tmp_path / "share.jsonl", [record]))
    array = tmp_path / "share.json"
    array.write_text(json.dumps([record]))
    from_array = load_conversations(array)
    assert from_jsonl == from_array == [Conversation(prompt_id_for(expected), expected)]


def test_parquet_with_struct_list_and_json_string_messages(tmp_path):
    structs = tmp_path / "structs.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"prompt_id": "x", "messages": [user("q"), assistant("a")]},
                {"prompt_id": "y", "messages": [user("r")]},
            ]
        ),
        structs,
    )
    text = tmp_path / "text.parquet"
    pq.write_table(pa.table({"messages": [json.dumps([user("q"), assistant("a")])]}), text)
    assert load_conversations(structs) == [
        Conversation("x", [user("q")]),
        Conversation("y", [user("r")]),
    ]
    assert load_conversations(text) == [Conversation(prompt_id_for([user("q")]), [user("q")])]


def test_a_record_without_a_user_turn_is_rejected_with_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"messages": [user("ok")]}, {"messages": [{"role": "system", "content": "s"}]}],
    )
    with pytest.raises(ConversationError, match=r"bad\.jsonl:2: no user turn"):
        load_conversations(path)
    only_assistant = write_jsonl(tmp_path / "a.jsonl", [{"messages": [assistant("a")]}])
    with pytest.raises(ConversationError, match=r"a\.jsonl:1: no user turn"):
        load_conversations(only_assistant)


def test_malformed_records_name_their_row(tmp_path):
    parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["no messages here"]}), parquet)
    with pytest.raises(ConversationError, match=r"bad\.parquet row 0: neither"):
        load_conversations(parquet)
    unknown_role = write_jsonl(
        tmp_path / "role.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}]
    )
    with pytest.raises(ConversationError, match=r"role\.jsonl:1: turn 0 needs a known 'role'"):
        load_conversations(unknown_role)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{not json\n')
    with pytest.raises(ConversationError, match=r"broken\.jsonl:2: not JSON"):
        load_conversations(broken)
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"messages": []}])
    with pytest.raises(ConversationError, match=r"empty\.jsonl:1: no turns"):
        load_conversations(empty)


def test_repeated_prompts_are_kept_once_but_conflicting_ids_fail(tmp_path):
    same = write_jsonl(
        tmp_path / "same.jsonl",
        [{"messages": [user("q"), assistant("a1")]}, {"messages": [user("q"), assistant("a2")]}],
    )
    assert len(load_conversations(same)) == 1
    conflict = write_jsonl(
        tmp_path / "conflict.jsonl",
        [{"id": "k", "messages": [user("q")]}, {"id": "k", "messages": [user("other")]}],
    )
    with pytest.raises(ConversationError, match=r"conflict\.jsonl:2: prompt_id 'k' already used"):
        load_conversations(conflict)


def test_batches_are_fixed_slices_that_survive_pool_growth():
    pool = [Conversation(str(i), [user(str(i))]) for i in range(25)]
    assert num_batches(25, 10) == 3 and num_batches(30, 10) == 3 and num_batches(0, 10) == 0
    assert [c.prompt_id for c in batch_slice(pool, 1, 10)] == [str(i) for i in range(10, 20)]
    assert [c.prompt_id for c in batch_slice(pool, 2, 10)] == ["20", "21", "22", "23", "24"]
    grown = [*pool, *(Conversation(str(i), [user(str(i))]) for i in range(25, 40))]
    assert batch_slice(grown, 1, 10) == batch_slice(pool, 1, 10)
    assert len(batch_slice(grown, 2, 10)) == 10
    with pytest.raises(IndexError, match="batch 3 is outside a pool of 25 prompts"):
        batch_slice(pool, 3, 10)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        num_batches(10, 0)


def test_batch_keys_round_trip_and_sort():
    assert batch_key(0) == "batch-00000" and batch_key(123) == "batch-00123"
    assert [parse_batch_key(batch_key(k)) for k in (0, 7, 99999, 123456)] == [0, 7, 99999, 123456]
    assert sorted(batch_key(k) for k in (10, 2, 1)) == [batch_key(k) for k in (1, 2, 10)]
    for bad in ("batch-1", "batch-0000a", "x-00001", "batch-00001 "):
        with pytest.raises(ValueError, match="not a batch key"):
            parse_batch_key(bad)
