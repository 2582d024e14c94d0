"""The media oracle: the reference (clef-finetune's joint_schema_model.py, SPEC §8) on records with images and videos,
with the release's `AutoProcessor` as the reference's own dependencies install it (with torchvision: transformers'
torchvision image processor, `Qwen2VLImageProcessor`, and its video processor), run in the oracle venv
(.ci/oracle-venv) by the `reference_oracle` fixture (tests/conftest.py) for tests/test_vision.py and tests/test_video.py.

    python reference.py WORKDIR

reads WORKDIR/spec.json: {"release": DIR, "records": [{"state", "questions", "images": [PNG path, ...], "videos":
[[frame PNG path, ...] or a video file's path, ...]}, ...]} and writes, per record i, WORKDIR/record{i}.json
(input_ids, spans, grids, logits, the processor classes) and its pixel values as record{i}_pixel_values.npy /
record{i}_pixel_values_videos.npy.

The processor is the release's `AutoProcessor`, fp32 model as `load_release_model` builds it, with one choice: a
video file is given to the processor as its path; the processor decodes paths with torchcodec, which needs FFmpeg's
shared libraries on the system, so its decoder is transformers' own PyAV reader (`read_video_pyav`); sampling,
metadata and everything after are the processor's. Imports nothing of clef-flash: this venv's torch is not the
project's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration
from transformers import video_processing_utils, video_utils

from clef_finetune._vendor import joint_schema_model as jsm


def use_pyav_for_paths() -> None:
    video_utils.VIDEO_DECODERS["torchcodec"] = video_utils.read_video_pyav
    video_utils.is_torchcodec_available = lambda: True
    video_processing_utils.is_torchcodec_usable = lambda **kwargs: True


def main(workdir: Path) -> None:
    torch.manual_seed(0)
    spec = json.loads((workdir / "spec.json").read_text())
    release = Path(spec["release"])
    use_pyav_for_paths()
    processor = AutoProcessor.from_pretrained(release)
    backbone = Qwen3_5ForConditionalGeneration.from_pretrained(release, dtype=torch.float32)
    head = jsm.JointSchemaHead(**json.loads((release / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(release / "joint_head.safetensors"), strict=True)
    model = jsm.ClefModel(backbone, head.float()).eval()
    for index, item in enumerate(spec["records"]):
        record = {"state": item["state"], "questions": item["questions"]}
        if item.get("images"):
            record["images"] = [Image.open(path) for path in item["images"]]
        if item.get("videos"):
            record["videos"] = [[Image.open(path) for path in video] if isinstance(video, list) else video for video in item["videos"]]
        encoded = jsm.encode_record(processor.tokenizer, record, processor=processor, max_length=65536)
        with torch.no_grad():
            logits = model(jsm.collate_records([encoded], processor.tokenizer.pad_token_id, torch.device("cpu")))[0]
        media = encoded.media or {}
        for key in ("pixel_values", "pixel_values_videos"):
            if key in media:
                np.save(workdir / f"record{index}_{key}.npy", media[key].numpy())
        out = {
            "input_ids": list(encoded.input_ids),
            "question_spans": [list(q.question_span) for q in encoded.questions],
            "option_spans": [[list(span) for span in q.option_spans] for q in encoded.questions],
            "image_grid_thw": media["image_grid_thw"].tolist() if "image_grid_thw" in media else [],
            "video_grid_thw": media["video_grid_thw"].tolist() if "video_grid_thw" in media else [],
            "logits": {q.question_id: dict(zip(q.option_ids, values.tolist())) for q, values in zip(encoded.questions, logits)},
            "processors": [type(processor.image_processor).__name__, type(processor.video_processor).__name__],
        }
        (workdir / f"record{index}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
