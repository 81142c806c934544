"""A head type added at run time shows up wherever head types show up, with no edit outside this
module: detection, loading, a stack file's e_m slot (HierSpec with it stays token-identical to AR),
the trace's head_types, its label and the training command's --head-type choices."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hierviz.settings import DecodeSettings
from hierviz.engine import generate, output_tokens
from hierviz.models.config import ModelConfig, read_config_json
from hierviz.models.drafter import (HEAD_TYPES, HeadType, head_label, head_type_of, is_drafter, load_head,
                                    register_head_type, trainable_head_types, unregister_head_type)
from hierviz.models.eagle import EagleHead, load_eagle_weights
from hierviz.models.llama import Transformer
from hierviz.stack import StackError, load_stack
from hierviz.trace import comparison_from_json, save_comparison
from hierviz.train import eagle_train
from tests.tiny import make_tiny_head, make_tiny_hf, make_tiny_tokenizer

TOY = "toy-head"
MARKER = "toy_head_format"      # the config key only the toy's detector knows


class ToyHead(EagleHead):
    """An EAGLE-1/2 head under its own head type: the toy's module is this class and its loader."""

    head_type = TOY


def load_toy_head(folder: str | Path, base: Transformer) -> ToyHead:
    return ToyHead(*load_eagle_weights(folder), base)


def is_toy_folder(folder: str | Path) -> bool:
    try:
        return MARKER in read_config_json(folder)
    except ValueError:
        return False


class ToyTrainer(eagle_train.Eagle2Trainer):
    """Trains the toy as EAGLE-1/2 trains its heads."""


TOY_TYPE = HeadType(TOY, "Toy head", load_toy_head, is_toy_folder, base_lm_head=True,
                    description="an EAGLE-1/2 head saved with a marker key")


@pytest.fixture
def toy():
    builtins = dict(HEAD_TYPES)
    register_head_type(TOY_TYPE)
    try:
        yield TOY_TYPE
    finally:
        unregister_head_type(TOY)
    assert HEAD_TYPES == builtins


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy-stack")
    make_tiny_hf(root / "target", "llama", seed=0, layers=3)
    make_tiny_tokenizer(root / "target")
    make_tiny_hf(root / "inter", "llama", seed=1, layers=1)
    make_tiny_head(root / "toy", ModelConfig.from_file(root / "inter"), seed=3)
    config = json.loads((root / "toy" / "config.json").read_text())
    (root / "toy" / "config.json").write_text(json.dumps({**config, MARKER: 1}))
    make_tiny_head(root / "e2", ModelConfig.from_file(root / "inter"), seed=3)
    return root


def write_stack(root: Path, **heads) -> str:
    spec = {"name": "toy", "target": {"path": "target"}, "intermediate": {"path": "inter"}, **heads}
    p = root / f"stack-{abs(hash(json.dumps(spec, sort_keys=True)))}.json"
    p.write_text(json.dumps(spec))
    return str(p)


def test_detected_and_loaded_by_its_own_registration(toy, folders) -> None:
    assert head_type_of(folders / "toy") == TOY and head_type_of(folders / "e2") == "eagle2"
    base = load_stack(write_stack(folders), "cpu").models.intermediate
    head = load_head(folders / "toy", base)
    assert isinstance(head, ToyHead) and is_drafter(head) and head.head_type == TOY
    assert head_label(TOY) == "Toy head"


def test_hierspec_with_the_toy_as_e_m_is_token_identical_to_ar(toy, folders) -> None:
    stack = load_stack(write_stack(folders, e_m={"path": "toy"}), "cpu")
    assert isinstance(stack.models.e_m, ToyHead) and stack.meta["head_types"] == {"e_m": TOY}
    s = DecodeSettings(max_new_tokens=16, m_depth=2, m_topk=3, m_tree_size=6)
    runs = {m: generate(stack, m, "w5 w7 w9", s) for m in ("hierspec", "ar")}
    assert output_tokens(runs["hierspec"]) == output_tokens(runs["ar"])
    assert runs["hierspec"].meta["head_types"]["e_m"] == TOY
    save_comparison(list(runs.values()), folders / "toy-comparison.json")
    again = comparison_from_json((folders / "toy-comparison.json").read_text())
    assert again[0].meta["head_types"] == {"e_m": TOY}
    # named in the stack file too; a slot that takes one head type refuses it
    assert load_stack(write_stack(folders, e_m={"path": "toy", "type": TOY}), "cpu").meta["head_types"]["e_m"] == TOY
    with pytest.raises(StackError, match=f"e_t holds an {TOY} head but e_t takes eagle2 heads"):
        load_stack(write_stack(folders, e_t={"path": "toy"}), "cpu")


def test_training_lists_it_only_with_a_trainer(toy, folders) -> None:
    args = ["--target", "t", "--data", "d", "--out-t", "o", "--head-type", TOY]
    assert TOY not in trainable_head_types()
    with pytest.raises(SystemExit):
        eagle_train._parse_args(args)
    register_head_type(dataclasses.replace(toy, trainer=ToyTrainer))
    try:
        assert TOY in trainable_head_types()
        assert isinstance(eagle_train.trainer_for(eagle_train._parse_args(args)), ToyTrainer)
    finally:
        register_head_type(toy)


def test_unregistered_it_is_gone(folders) -> None:
    register_head_type(TOY_TYPE)
    unregister_head_type(TOY)
    assert TOY not in HEAD_TYPES and head_type_of(folders / "toy") == "eagle2" and head_label(TOY) == TOY
    with pytest.raises(StackError, match="is not a head type"):
        load_stack(write_stack(folders, e_m={"path": "toy", "type": TOY}), "cpu")
