"""Loader, config, guardrails and prompt-file errors name the file, and the line or field
(`specdec_fast.files`): corrupt or truncated safetensors, pickle payloads, malformed JSON and
YAML, config fields of the wrong kind."""

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import tiny_llama

from specdec_fast.files import FileFormatError, read_json
from specdec_fast.guardrails import Guardrails
from specdec_fast.harness.prompts import load_prompts
from specdec_fast.heads.checkpoint import read_config, read_safetensors, read_weights
from specdec_fast.heads.medusa import load_medusa_heads
from specdec_fast.loading import load_model


class Payload:
    """Any Python object: a pickle of one could run code when loaded."""


def test_weights_files_that_are_not_tensors_are_named(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(4)}, str(good))
    (tmp_path / "truncated.safetensors").write_bytes(good.read_bytes()[:40])
    with pytest.raises(FileFormatError, match=r"truncated.safetensors: not a readable safetensors"):
        read_weights(tmp_path, ["truncated.safetensors"])
    torch.save({"w": Payload()}, tmp_path / "pickle.pt")
    with pytest.raises(
        FileFormatError,
        match=r"pickle.pt: not a safetensors checkpoint or a weights-only tensor file",
    ):
        read_weights(tmp_path, ["pickle.pt"])
    torch.save({"w": torch.ones(4)}, tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:100])
    with pytest.raises(FileFormatError, match=r"cut.pt: not a readable PyTorch tensor file"):
        read_weights(tmp_path, ["cut.pt"])
    assert torch.equal(read_weights(tmp_path, ["whole.pt"])["w"], torch.ones(4))


def test_config_errors_name_the_file_and_the_line_or_field(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "hidden_size": 32,\n  "vocab_size": 9,,\n}')
    with pytest.raises(FileFormatError, match=r"config.json: not valid JSON: .* at line 3"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": "32"}')
    with pytest.raises(FileFormatError, match=r"config.json: field 'hidden_size': expected an int"):
        read_config(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": []}')
    with pytest.raises(FileFormatError, match=r"index.json: field 'weight_map'"):
        read_safetensors(tmp_path)
    with pytest.raises(FileFormatError, match=r"absent.json: cannot read it"):
        read_json(tmp_path / "absent.json")


def test_model_folders_with_broken_files_are_named(tmp_path):
    tiny_llama(vocab_size=32, hidden_size=16, layers=1).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    with pytest.raises(FileFormatError, match=r"weights are not a readable safetensors file"):
        load_model(str(tmp_path), torch.device("cpu"))
    config = tmp_path / "config.json"
    config.write_text(
        config.read_text().replace('"num_hidden_layers": 1', '"num_hidden_layers": 1.5')
    )
    with pytest.raises(FileFormatError, match=r"config.json: field 'num_hidden_layers'"):
        load_model(str(tmp_path), torch.device("cpu"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("speculative_decoding_guardrails:\n  window_steps: [4\n", r"not valid YAML at line 3"),
        (
            "speculative_decoding_guardrails: !!python/object:os.system {}\n",
            r"line 1.*tags are refused",
        ),
        ("speculative_decoding_guardrails:\n  window_steps: -1\n", r"window_steps"),
    ],
    ids=["syntax", "python-tag", "field"],
)
def test_guardrails_yaml_errors_name_the_file(tmp_path, text, message):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(FileFormatError, match=rf"{path}: .*{message}"):
        Guardrails.from_yaml(path)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"prompt": "x", "temperature": NaN}', r"rows.jsonl:2.temperature: expected"),
        ('{"prompt": "x", "temperature": 1e-40}', r"rows.jsonl:2.temperature: expected"),
        ('{"prompt": "x", "max_new_tokens": -4}', r"rows.jsonl:2.max_new_tokens"),
        ('{"prompt": "x"', r"rows.jsonl:2: invalid JSON"),
    ],
)
def test_prompt_rows_are_validated_naming_file_and_line(tmp_path, row, message):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "fine"}\n' + row + "\n")
    with pytest.raises(ValueError, match=message):
        load_prompts(path)


def test_a_pickle_payload_as_a_draft_models_weights_is_refused_in_one_line(tmp_path):
    tiny_llama(vocab_size=32, hidden_size=16, layers=1).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileFormatError) as refused:
        load_model(str(tmp_path), torch.device("cpu"))
    message = str(refused.value)
    assert message.startswith(f"{tmp_path}: its PyTorch weights hold pickled Python objects")
    assert "\n" not in message


def test_medusa_head_counts_of_the_wrong_kind_name_field_and_file(tmp_path):
    (tmp_path / "config.json").write_text('{"medusa_num_heads": "abc", "medusa_num_layers": 1}')
    with pytest.raises(ValueError, match=r"config.json's medusa_num_heads: expected an integer"):
        load_medusa_heads(tmp_path)
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 2, "medusa_num_layers": 0}')
    with pytest.raises(ValueError, match=rf"{tmp_path}.*medusa_num_layers: .* got 0"):
        load_medusa_heads(tmp_path)


def test_a_guardrails_path_with_a_colon_is_read_as_a_path(tmp_path):
    folder = tmp_path / "a:b"
    folder.mkdir()
    path = folder / "policy.yaml"
    path.write_text("speculative_decoding_guardrails:\n  min_acceptance_rate: 0.25\n")
    assert Guardrails.from_yaml(str(path)).default.min_acceptance_rate == 0.25
    missing = str(folder / "missing.yaml")
    with pytest.raises(FileFormatError, match=rf"^{missing}: no such file"):
        Guardrails.from_yaml(missing)
