# TRL's SFTTrainer with both offload modes: a tiny Llama built from a config, a
# word-level tokenizer built in the test, an in-memory text dataset (CPU,
# nothing downloaded). The default mode logs bit-identical losses to plain
# torch.optim.AdamW; full offload stays within bf16 noise of Bf16MasterAdamW.
# Skipped, with the reason shown, when trl (or datasets, tokenizers) is missing.

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

import cpu_offload  # noqa: E402
from helpers import (  # noqa: E402
    BF16_LOSS_ATOL, VOCAB, Bf16MasterAdamW, adamw, assert_trains, loss_report, tiny_llama, token_rows,
)

# NOTE: a deprecation inside the framework itself, not in these tests or this package.
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def word_tokenizer():
    """One word per token id: "<pad>" 0, "<s>" 1, "</s>" 2, "w3" ... "w127"."""
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<pad>")


def text_dataset(n):
    # rows of 8 to 12 words, so the collator pads
    texts = [" ".join(f"w{int(t)}" for t in row[:8 + i % 5]) for i, row in enumerate(token_rows(n))]
    return datasets.Dataset.from_dict({"text": texts})


def train_sft(tmp_path, make_opt, *, grad_accum, **extra_args):
    model = tiny_llama()
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    config = trl.SFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=grad_accum,
        num_train_epochs=1, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, seed=7, max_length=16, packing=False, dataset_text_field="text", **extra_args)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=text_dataset(40 * grad_accum),
                             processing_class=word_tokenizer(), optimizers=(opt, sched))
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], opt


def test_sft_default_mode_bit_identical_to_adamw(tmp_path):
    want, _ = train_sft(tmp_path, lambda m: adamw(m.parameters()), grad_accum=1, max_grad_norm=1.0)
    got, _ = train_sft(tmp_path, lambda m: cpu_offload.offload_optimizer(adamw(m.parameters())),
                       grad_accum=1, max_grad_norm=1.0)
    diff, line = loss_report("SFTTrainer offload='optimizer' vs AdamW", got, want)
    assert len(got) == 20
    assert got == want, line
    assert_trains(got, line)


def test_sft_full_offload_within_bf16_noise(tmp_path):
    want, _ = train_sft(tmp_path, lambda m: Bf16MasterAdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95),
                                                            weight_decay=0.1),
                        grad_accum=2, max_grad_norm=0.0)
    got, opt = train_sft(
        tmp_path, lambda m: cpu_offload.offload_optimizer(adamw(m.parameters()), offload="full", grad_accum_steps=2),
        grad_accum=2, max_grad_norm=0.0)
    opt.close()
    diff, line = loss_report("SFTTrainer offload='full' grad_accum=2 vs bf16 reference", got, want)
    assert len(got) == 20
    assert diff < BF16_LOSS_ATOL, line
    assert_trains(got, line)
