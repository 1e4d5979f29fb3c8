"""On a GPU: transformers' greedy generation from a pure-GDN export (flash-linear-attention's
GatedDeltaNetForCausalLM, its recurrent cache; the export's tokenizer and generation_config.json)
continues a prompt with the tokens our model's greedy continuation gives, token for token.

The model is trained (fp32) on text where each word is followed by one word, so its choices have
clear margins: greedy decoding is compared, not logits (test_fla_gpu.py compares those). Our model
has no generate: conftest.greedy_continuation runs the whole sequence again for every new token and
takes the argmax of the last logits, stopping at the export's eos.
"""
import pytest
import torch

from gdn_parallel.convert import model_from_hf
from gdn_parallel.convert.__main__ import main as convert
from gdn_parallel.train.__main__ import run as train
from tests.tokenized_data import WORDS, prepare_bpe_dataset

from .conftest import greedy_continuation, skip_unless_fla_generate_works

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                                          "(pip install -e '.[dev]')")
fla_models = pytest.importorskip("fla.models", reason="flash-linear-attention is not installed")
skip_unless_fla_generate_works()

SETTINGS = {"model.vocab_size": 300, "model.hidden_size": 256, "model.n_layers": 2,
            "model.layer_pattern": "G", "model.gdn_num_heads": 2, "model.gdn_head_dim": 64,
            "model.gdn_expand_v": 2.0, "model.tie_word_embeddings": False, "train.seq_len": 256,
            "train.batch_size": 8, "train.steps": 80, "train.warmup_steps": 5, "train.lr": 3e-3,
            "train.log_every": 20, "train.eval_every": 0, "train.dtype": "float32"}
NEW_TOKENS = 48


def cyclic_documents(count: int = 400):
    """Word i is always followed by word i + 1 (of WORDS, cyclically); documents start anywhere."""
    return [" ".join(WORDS[(start + k) % len(WORDS)] for k in range(20 + start % 30))
            for start in range(count)]


def test_transformers_generation_from_an_export_is_our_greedy_continuation(tmp_path):
    data = prepare_bpe_dataset(tmp_path / "bpe", cyclic_documents())
    overrides = [x for key, value in {**SETTINGS, "data.source": data}.items()
                 for x in ("--set", f"{key}={value}")]
    train(overrides + ["--set", f"train.out_dir={tmp_path / 'run'}"])
    folder = tmp_path / "hf"
    assert convert(["to-hf", str(tmp_path / "run"), str(folder)]) == 0

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    generation = transformers.GenerationConfig.from_pretrained(folder)
    theirs = fla_models.GatedDeltaNetForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    ours = model_from_hf(folder, device="cuda").eval()
    for start in (3, 11):
        text = " ".join(WORDS[(start + k) % len(WORDS)] for k in range(6))
        prompt = torch.tensor([[tokenizer.bos_token_id]
                               + tokenizer(text, add_special_tokens=False).input_ids], device="cuda")
        expected, margin = greedy_continuation(ours, prompt, NEW_TOKENS, generation.eos_token_id)
        with torch.no_grad():
            generated = theirs.generate(prompt, generation_config=generation, max_new_tokens=NEW_TOKENS,
                                        do_sample=False)
        continuation = generated[0, prompt.shape[1]:].tolist()
        print(f"prompt {text!r}: {len(expected)} tokens, smallest top-2 logit margin {margin:.3f}; "
              f"{tokenizer.decode(expected)!r}")
        assert continuation == expected
