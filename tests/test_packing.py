"""Packed sequences (padding-free training): `DataCollatorWithFlattening` concatenates documents into one row with
position_ids restarting at 0 (and, optionally, the flash-attention `cu_seq_lens_*` kwargs). DINT's integral must
restart at each document, and attention must not cross documents: each document's logits in the packed row equal
the logits of that document run alone."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from dint_testing import LAYOUTS, tiny_model


DOCUMENT_LENGTHS = (7, 12, 5)


def _documents(vocab_size=128, lengths=DOCUMENT_LENGTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (length,), generator=generator).tolist() for length in lengths]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("return_flash_attn_kwargs", [False, True])
def test_packed_row_logits_equal_each_document_alone(attn_implementation, use_cache, return_flash_attn_kwargs, layout):
    model = tiny_model(attn_implementation, use_cache=use_cache, **layout)
    documents = _documents()
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=return_flash_attn_kwargs)
    batch = collator([{"input_ids": document} for document in documents])
    assert batch["input_ids"].shape == (1, sum(DOCUMENT_LENGTHS))
    if return_flash_attn_kwargs:
        assert batch["cu_seq_lens_q"].tolist() == [0, 7, 19, 24]
    labels = batch.pop("labels")

    with torch.no_grad():
        packed_logits = model(**batch).logits[0]
        offset = 0
        for document in documents:
            alone_logits = model(torch.tensor([document])).logits[0]
            torch.testing.assert_close(packed_logits[offset : offset + len(document)], alone_logits, rtol=0, atol=1e-5)
            offset += len(document)

        # The packed loss is the mean of the per-document next-token losses (the collator separates documents
        # with -100 in the labels).
        packed_loss = model(**batch, labels=labels).loss
        token_losses = []
        for document in documents:
            logits = model(torch.tensor([document])).logits[0, :-1]
            token_losses.append(
                torch.nn.functional.cross_entropy(logits, torch.tensor(document[1:]), reduction="none")
            )
        torch.testing.assert_close(packed_loss, torch.cat(token_losses).mean(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packing_restart_matters(attn_implementation):
    """Guards the test above: run as a continuation of the first document (positions not restarted), the second
    document's logits differ from its logits alone, so the equality above comes from the restart."""
    model = tiny_model(attn_implementation)
    first, second = _documents(lengths=(7, 12))
    with torch.no_grad():
        continued_logits = model(torch.tensor([first + second])).logits[0, len(first) :]
        alone_logits = model(torch.tensor([second])).logits[0]
    assert (continued_logits - alone_logits).abs().max() > 1e-3
