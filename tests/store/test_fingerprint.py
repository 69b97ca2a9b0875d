"""Keys explain a miss in words: each changed component is a sentence naming it and both values,
and the raw difference (each component whole, as the keys hold it) stays for the details."""

from __future__ import annotations

from store.fingerprint import Key, describe, diff, raw_difference


def test_a_changed_component_is_a_sentence_naming_it_and_both_values():
    old, new = Key.of({"torch": "2.13.0", "backend": "export"}), Key.of({"torch": "2.14.1", "backend": "export"})
    assert describe(diff(old, new)) == "torch is 2.13.0 here; this launch uses 2.14.1"


def test_a_structured_component_names_its_differing_facts_not_two_blobs():
    sig = {"dims": {"T": [1, 512]}, "inputs": ["x", "cache"]}
    old = Key.of({"layout": {"max_seq": 512, "ranks": 1}, "signature": sig})
    new = Key.of({"layout": {"max_seq": 1024, "ranks": 1}, "signature": {**sig, "dims": {"T": [1, 1024]}},
                  "mtp": True})
    assert describe(diff(old, new)).split(". ") == [
        "layout's max_seq is 512 here; this launch uses 1024",
        "signature's dims.T is [1,512] here; this launch uses [1,1024]",
        "mtp is absent here; this launch uses true",
    ]
    assert raw_difference(diff(old, new)) == {
        "layout": '{"max_seq":512,"ranks":1} → {"max_seq":1024,"ranks":1}',
        "signature": '{"dims":{"T":[1,512]},"inputs":["x","cache"]} → {"dims":{"T":[1,1024]},"inputs":["x","cache"]}',
        "mtp": "(absent) → true",
    }
    assert describe(diff(new, old)).endswith("mtp is true here; this launch has none")
