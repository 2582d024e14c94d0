"""Token-level attributions through Captum: integrated gradients, or gradient x input, over the decoder's input
embeddings (an image's or video's pads: the vision tower's features, as the decoder reads them), summed per token
and per part.

The function attributed maps the record's input embeddings [B, T, D] to every option's probability [B, No]: the
decoder (its delta rule token by token: the chunked form is not differentiable as written), then the joint head
and a softmax per question. Only the parts' tokens move: the baseline is the input with every part's token replaced
by the padding token's embedding (a state of nothing), every other token (prompt, schema) at its own, so the prompt
and schema get no attribution. (Not zeros: the decoder's first op is an RMSNorm, scale-invariant, whose gradient
grows as 1/alpha along a path from 0; measured on tiny, the attributions' sum then moved from 4e-4 to -1.6e-2
between 16 and 64 steps, while from the padding it converges: convergence delta 3.5e-4, then 4.2e-5.) Integrated
gradients' attributions of an option sum to p(input) - p(baseline) up to the path integral's error
(`convergence_delta`; more `steps` shrink it).

It needs gradients through the weights as they compute: fp32 or bf16 (fp64). Under an 8-bit precision or the Core
ML backend it is refused with the precision to load instead. Attributions are computed in fp32 whatever the
model's activations.
"""

from __future__ import annotations

import time

import torch

from ..errors import ClefError, RequestInvalid
from ..model.head_batch import build_head_batch, softmax_per_question
from ..model.precision import compute_dtype
from ..plan import TORCH
from ..prefill import media_inputs, row_media
from .job import ExplainJob, explained_questions
from .request import INTEGRATED_GRADIENTS
from .result import Cost, ExplainedOption, ExplainedToken, Explanation

# Rows of T tokens in one forward + backward: at most this many tokens (a backward holds every layer's activations).
GRADIENT_TOKENS = 2048
# The most forward + backward passes one explanation runs (options explained x steps): a server's model worker runs an
# explanation whole, between batches, and cannot stop it half-way.
MOST_PASSES = 2048


def check_gradients(model) -> None:
    """Refuse token-level attributions where gradients through the model are not available (`model`: a Clef)."""
    plan = model.plan
    if plan.backend != TORCH or model.parts is None:
        why = "the Core ML backend runs fixed packages, without gradients"
    elif plan.precision.quantized:
        why = f"this model runs {plan.name}: gradients through 8-bit weights are not computed here"
    else:
        return
    raise RequestInvalid(
        [
            {
                "type": "explain_method_unsupported",
                "loc": ["body", "method"],
                "msg": f"token-level attributions need a model loaded in fp32 or bf16; {why}. Load it with "
                'precision="fp32" (or "bf16"; --precision fp32), or use method "leave-out", which any model runs',
            }
        ]
    )


def check_passes(job: ExplainJob) -> None:
    """Refuse an explanation of more than MOST_PASSES forward + backward passes, saying how to make it fewer."""
    options = sum(len(question.option_ids) for question in job.prepared.record.questions if question.question_id in job.question_ids)
    steps = job.options.steps if job.options.method == INTEGRATED_GRADIENTS else 1
    if options * steps > MOST_PASSES:
        per = f"{options} options x {steps} steps" if steps > 1 else f"{options} options"
        raise RequestInvalid(
            [
                {
                    "type": "explain_too_costly",
                    "loc": ["body", "question_ids"],
                    "msg": f"{job.options.method} here would run {options * steps} forward and backward passes ({per}), "
                    f"over {MOST_PASSES}: explain fewer questions (question_ids), take fewer steps, or use method \"leave-out\"",
                    "ctx": {"passes": options * steps, "most": MOST_PASSES},
                }
            ]
        )


def run_gradients(model, job: ExplainJob) -> Explanation:
    """Per reported option: its attribution to every token of the parts, and their sums per part."""
    try:
        from captum.attr import InputXGradient, IntegratedGradients
    except ImportError:
        raise ClefError("token-level attributions need Captum: pip install 'clef-flash[explain]'") from None
    started = time.perf_counter()
    record = job.prepared.record
    (full,) = model.score([record])
    targets = [
        (question, option)
        for question, result in enumerate(full)
        if result.question_id in job.question_ids
        for option in range(len(result.option_ids))
    ]
    flat = _flat_indices(full)
    attributed = Attributed(model, record)
    low, high = min(start for start, _ in job.spans), max(end for _, end in job.spans)
    baseline = attributed.embeds.clone()
    baseline[:, low:high] = attributed.padding  # every part's token as the padding token: a state of nothing
    count = len(targets)
    inputs, baselines = attributed.embeds.expand(count, -1, -1).contiguous(), baseline.expand(count, -1, -1).contiguous()
    target = [flat[question][option] for question, option in targets]
    rows = max(1, GRADIENT_TOKENS // record.token_count)  # per forward + backward; targets go `rows` at a time
    chunks = [slice(at, at + rows) for at in range(0, count, rows)]
    deltas = None
    with torch.inference_mode(False), torch.enable_grad():
        if job.options.method == INTEGRATED_GRADIENTS:
            explainer, steps = IntegratedGradients(attributed), job.options.steps
            pieces = [
                explainer.attribute(inputs[chunk], baselines[chunk], target=target[chunk], n_steps=steps, internal_batch_size=rows, return_convergence_delta=True)
                for chunk in chunks
            ]
            scores, deltas = torch.cat([piece[0] for piece in pieces]), torch.cat([piece[1] for piece in pieces])
            passes = count * steps
        else:
            explainer = InputXGradient(attributed)
            inputs.requires_grad_()  # (Captum would, and warn)
            scores = torch.cat([explainer.attribute(inputs[chunk], target=target[chunk]) for chunk in chunks])
            passes = count
    per_token = scores.detach().sum(-1)[:, low:high].double()  # [targets, tokens]
    by_target = {pair: index for index, pair in enumerate(targets)}
    spans = [(start - low, end - low) for start, end in job.spans]

    def explain_option(question: int, option: int) -> ExplainedOption:
        index = by_target[(question, option)]
        tokens = per_token[index]
        return ExplainedOption(
            full[question].option_ids[option],
            full[question].probabilities[option],
            tuple(float(tokens[start:end].sum()) for start, end in spans),
            token_scores=tuple(tokens.tolist()),
            convergence_delta=None if deltas is None else float(deltas[index]),
        )

    questions = explained_questions(job, full, explain_option)
    tokens = tuple(
        ExplainedToken(position, model.tokenizer.decode([record.input_ids[position]]), job.owner(position)) for position in range(low, high)
    )
    milliseconds = (time.perf_counter() - started) * 1000
    cost = Cost(1, record.token_count, passes * record.token_count, passes, milliseconds)
    return Explanation(job.options.method, job.model_name, job.explained_parts(), questions, record.token_count, cost, tokens)


class Attributed(torch.nn.Module):
    """A record's input embeddings [B, T, D] (fp32) -> every option's probability [B, No]; `embeds` [1, T, D] are
    the record's own (the vision tower's features at its media's pads)."""

    def __init__(self, model, record):
        super().__init__()
        parts = model.parts
        self.decoder, self.head, self.lm_head, self.record = parts.decoder, parts.head, parts.lm_head, record
        device, dtype = model.device, parts.decoder.dtype
        self.input_ids = torch.tensor([record.input_ids], device=device)  # [1, T]
        with torch.no_grad():
            media = row_media(parts.vision, [record.input_ids], [record.media], [0], dtype=dtype, device=device)
            if media is None:
                embeds, self.positions = self.decoder.embed_tokens(self.input_ids).to(dtype), None
            else:
                step = media_inputs(self.decoder, self.input_ids, media, [0], [record.token_count])
                embeds, self.positions = step["embeds"], step["positions"]  # [1, T, D], [3, 1, T]
        self.embeds = embeds.detach().to(compute_dtype(dtype))
        pad = torch.tensor([model.tokenizer.pad_id], device=device)
        self.padding = self.decoder.embed_tokens(pad).detach().to(self.embeds.dtype)  # [1, D]
        self.batches: dict[int, object] = {}

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        rows, length = embeds.shape[0], self.record.token_count
        if rows not in self.batches:
            self.batches[rows] = build_head_batch([self.record] * rows, self.embeds.device)
        batch = self.batches[rows]
        positions = None if self.positions is None else self.positions.expand(3, rows, length)
        hidden = self.decoder(self.input_ids.expand(rows, length), embeds=embeds.to(self.decoder.dtype), positions=positions)
        logits = self.head(hidden, torch.full((rows,), length), batch, self.lm_head)  # [rows * No]
        return softmax_per_question(logits, batch).view(rows, -1)  # [rows, No]


def _flat_indices(results) -> list[list[int]]:
    """Per question, per option (model order): its index in the head's flat output of one record."""
    flat, at = [], 0
    for result in results:
        flat.append(list(range(at, at + len(result.option_ids))))
        at += len(result.option_ids)
    return flat
