"""The media routes against a live loopback server: ``/v1/images/generations`` through the
official ``openai`` client equals ``diffusion-rl generate`` for the same seed and is bitwise
the same batched or alone; ``/v1/videos`` jobs (a workflow, text- and image-to-video) go
queued → completed, list, serve a GIF and exact tensors equal to ``generate --workflow``,
and delete; bad media requests are 4xx naming the field."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import numpy as np  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from flow_toy import one_thread, perturbed  # noqa: E402, F401 (fixture: one CPU thread)
from PIL import Image  # noqa: E402
from serve_live import LiveServer, write_token_model  # noqa: E402

from diffusion_rl import cli  # noqa: E402
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig  # noqa: E402
from diffusion_rl.models.io import save_model  # noqa: E402
from diffusion_rl.models.video_dit import VideoDiT, VideoDiTConfig  # noqa: E402
from diffusion_rl.sampling import flow as flow_sampling  # noqa: E402
from diffusion_rl.serving.engine import (  # noqa: E402
    load_served_model,
    load_served_workflow,
)
from diffusion_rl.serving.media import FORWARD_ROWS, encode_png  # noqa: E402
from diffusion_rl.workflows import stage_seed  # noqa: E402

WORDS = ("a", "red", "blue", "circle", "square", "moving", "left", "right")
SAMPLER = {"num_steps": 3, "guidance_scale": 2.0, "shift": 1.0}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_media")
    torch.manual_seed(0)
    small = {"image_size": 8, "patch_size": 4, "d_model": 32, "n_layers": 1, "n_heads": 2}
    image = perturbed(FlowDiT(FlowDiTConfig(**small, vocabulary=WORDS))).eval()
    video = perturbed(VideoDiT(VideoDiTConfig(**small, vocabulary=WORDS, num_frames=3))).eval()
    save_model(root / "painter", image, {"sampler": SAMPLER})
    save_model(root / "animator", video, {"sampler": SAMPLER})
    write_token_model(root / "tiny")
    spec = {
        "name": "t2i2v",
        "stages": [
            {"name": "image", "model": "painter", "sampler": SAMPLER},
            {"name": "video", "model": "animator", "input": "image", "sampler": SAMPLER},
        ],
    }
    (root / "flow.yaml").write_text(yaml.safe_dump(spec))
    return root


@pytest.fixture(scope="module")
def live(dirs):
    served = [
        load_served_model("painter", dirs / "painter"),
        load_served_model("animator", dirs / "animator"),
        load_served_model("tiny", dirs / "tiny"),
        load_served_workflow("t2i2v", dirs / "flow.yaml"),
    ]
    server = LiveServer(served=served, max_wait_ms=150.0, max_images=8, max_steps=50)
    yield server
    server.stop()


def png_pixels(data: str) -> torch.Tensor:
    """uint8 [3, H, W] of a base64 PNG."""
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        assert image.format == "PNG" and image.mode == "RGB"
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    return (images.clamp(0, 1) * 255).round().to(torch.uint8)


def test_images_parse_with_openai_and_equal_the_cli(live, dirs, monkeypatch, tmp_path):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    n = FORWARD_ROWS  # one full forward group: the CLI's batch of n has the same shape
    response = client.images.generate(
        model="painter",
        prompt="a red circle",
        n=n,
        size="8x8",
        response_format="b64_json",
        extra_body={"seed": 5},
    )
    assert isinstance(response, openai.types.ImagesResponse)
    served = [png_pixels(item.b64_json) for item in response.data]
    assert [item.model_extra["seed"] for item in response.data] == list(range(5, 5 + n))
    extra = response.model_extra
    assert extra["weights_version"] == 0
    assert extra["weights_checksum"] == live.engine.get("painter").checksum
    assert response.to_dict()["usage"] == {"images": n, "num_inference_steps": 3}
    assert set(extra["timings"]) == {"queue_ms", "compute_ms", "total_ms", "batch_rows"}

    made = []  # the float images `diffusion-rl generate` samples (before its captioned grid)
    original = flow_sampling.sample_flow

    def recording(*args, **kwargs):
        sample = original(*args, **kwargs)
        made.append(sample.images.float())
        return sample

    monkeypatch.setattr(flow_sampling, "sample_flow", recording)
    argv = ["generate", "--model", str(dirs / "painter"), "--prompt", "a red circle"]
    argv += ["--samples", str(n), "--seed", "5", "--output", str(tmp_path / "grid.png")]
    assert cli.main(argv) == 0
    (expected,) = made
    assert torch.equal(torch.stack(served), to_uint8(expected))
    assert len({tuple(p.flatten().tolist()) for p in served}) == n  # the seeds differ
    assert encode_png(expected[0]) == base64.b64decode(response.data[0].b64_json)


def _post_images(live, body) -> dict:
    status, head, data = live.json("POST", "/v1/images/generations", body)
    assert status == 200, data
    assert head["x-weights-version"] == "0"
    return data


def test_images_are_bitwise_the_same_batched_or_alone(live):
    bodies = [
        {"model": "painter", "prompt": p, "n": n, "seed": s}
        for p, n, s in [("a red circle", 1, 0), ("blue square", 2, 10), ("a circle", 3, 20)]
    ]
    bodies.append({**bodies[0], "negative_prompt": "blue", "seed": 40})
    alone = [_post_images(live, body) for body in bodies]
    assert [a["timings"]["batch_rows"] for a in alone] == [1, 2, 3, 1]
    merged: list = [None] * 6
    threads = [
        threading.Thread(
            target=lambda i=i: merged.__setitem__(i, _post_images(live, bodies[i % 3]))
        )
        for i in range(6)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert max(m["timings"]["batch_rows"] for m in merged) > 3  # requests were merged
    for i, result in enumerate(merged):
        assert [d["b64_json"] for d in result["data"]] == [
            d["b64_json"] for d in alone[i % 3]["data"]
        ]
    # a negative prompt changes the guidance branch (and is keyed apart from the others)
    assert (
        alone[3]["data"][0]["b64_json"]
        != _post_images(live, {**bodies[0], "seed": 40})["data"][0]["b64_json"]
    )


def _wait(live, video_id: str) -> dict:
    for _ in range(400):
        status, _, job = live.json("GET", f"/v1/videos/{video_id}")
        assert status == 200
        if job["status"] in ("completed", "failed"):
            return job
        assert job["status"] in ("queued", "in_progress")
        time.sleep(0.05)
    raise AssertionError(f"video job {video_id} did not finish")


def test_video_job_lifecycle_equals_generate_workflow(live, dirs, tmp_path, capsys):
    status, head, job = live.json(
        "POST", "/v1/videos", {"model": "t2i2v", "prompt": "a red circle", "n": 2, "seed": 3}
    )
    assert status == 200 and job["status"] == "queued" and job["object"] == "video"
    done = _wait(live, job["id"])
    assert done["status"] == "completed", done["error"]
    assert done["size"] == "8x8" and done["frames"] == 3 and done["usage"]["videos"] == 2
    assert done["weights_checksum"] == live.engine.get("t2i2v").checksum
    status, _, listed = live.json("GET", "/v1/videos")
    assert job["id"] in [j["id"] for j in listed["data"]]

    status, head, gif = live.request("GET", f"/v1/videos/{job['id']}/content")
    assert status == 200 and head["content-type"] == "image/gif" and gif[:4] == b"GIF8"
    status, _, raw = live.request("GET", f"/v1/videos/{job['id']}/content?variant=tensors")
    served = safetensors.torch.load(raw)
    output = tmp_path / "clips.safetensors"
    argv = ["generate", "--workflow", str(dirs / "flow.yaml"), "--prompt", "a red circle"]
    assert cli.main([*argv, "--samples", "2", "--seed", "3", "--output", str(output)]) == 0
    capsys.readouterr()
    expected = safetensors.torch.load_file(str(output))
    assert set(served) == set(expected) == {"image", "video", "image.seeds", "video.seeds"}
    for key in expected:
        assert torch.equal(served[key], expected[key]), key

    status, _, deleted = live.json("DELETE", f"/v1/videos/{job['id']}")
    assert status == 200 and deleted == {
        "id": job["id"],
        "object": "video.deleted",
        "deleted": True,
    }
    assert live.json("GET", f"/v1/videos/{job['id']}")[0] == 404


def test_image_to_video_conditions_on_the_reference(live, dirs):
    image = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(1))
    png = encode_png(image)
    reference = torch.from_numpy(np.array(Image.open(io.BytesIO(png)))).permute(2, 0, 1) / 255
    body = {"prompt": "a blue square", "seed": 7, "input_reference": base64.b64encode(png).decode()}
    results = {}
    for model in ("animator", "t2i2v"):
        status, _, job = live.json("POST", "/v1/videos", {**body, "model": model})
        assert status == 200, job
        assert _wait(live, job["id"])["status"] == "completed"
        _, _, raw = live.request("GET", f"/v1/videos/{job['id']}/content?variant=tensors")
        results[model] = safetensors.torch.load(raw)["video"]
    video = live.engine.get("animator").model
    images = reference[None].float()
    cond = video.encode_conditioning(["a blue square"], images)
    uncond = video.empty_conditioning(images)
    config = flow_sampling.FlowSamplerConfig(**SAMPLER)
    direct = flow_sampling.sample_flow(
        video, ["a blue square"], config, seeds=[7], cond=cond, uncond=uncond
    )
    assert torch.equal(results["animator"], direct.images.float())
    # the workflow skips its image stage: the video stage's seed is grown from the row seed
    staged = flow_sampling.sample_flow(
        video, ["a blue square"], config, seeds=[stage_seed(7, 1, 0)], cond=cond, uncond=uncond
    )
    assert torch.equal(results["t2i2v"], staged.images.float())


BAD = [
    (
        "images",
        {"model": "painter", "prompt": "a red circle", "response_format": "url"},
        400,
        "response_format",
    ),
    ("images", {"model": "painter", "prompt": "a red circle", "size": "16x16"}, 400, "size"),
    ("images", {"model": "painter", "prompt": "a red circle", "size": "big"}, 400, "size"),
    ("images", {"model": "painter", "prompt": "a red circle", "size": "4096x8"}, 400, "size"),
    ("images", {"model": "painter", "prompt": "a red circle", "n": 9}, 400, "n"),
    ("images", {"model": "painter", "prompt": "a red circle", "n": 0}, 400, "n"),
    (
        "images",
        {"model": "painter", "prompt": "a red circle", "num_inference_steps": 51},
        400,
        "num_inference_steps",
    ),
    (
        "images",
        {"model": "painter", "prompt": "a red circle", "guidance_scale": -1.0},
        400,
        "guidance_scale",
    ),
    ("images", {"model": "painter", "prompt": "a red circle", "seed": "3"}, 400, "seed"),
    ("images", {"model": "painter", "prompt": "a purple circle"}, 400, "prompt"),
    (
        "images",
        {"model": "painter", "prompt": "a red circle", "negative_prompt": "green"},
        400,
        "negative_prompt",
    ),
    ("images", {"model": "painter", "prompt": ""}, 400, "prompt"),
    ("images", {"model": "painter", "prompt": "a red circle", "style": "vivid"}, 400, "style"),
    ("images", {"model": "nobody", "prompt": "a red circle"}, 404, "model"),
    ("images", {"model": "tiny", "prompt": "1+2="}, 400, "model"),
    ("images", {"model": "animator", "prompt": "a red circle"}, 400, "model"),
    ("images", {"prompt": "a red circle"}, 400, "model"),
    ("videos", {"model": "painter", "prompt": "a red circle"}, 400, "model"),
    ("videos", {"model": "animator", "prompt": "a red circle"}, 400, "input_reference"),
    (
        "videos",
        {"model": "animator", "prompt": "a red circle", "input_reference": "@@"},
        400,
        "input_reference",
    ),
    ("videos", {"model": "t2i2v", "prompt": "a red circle", "seconds": "4"}, 400, "seconds"),
    ("videos", {"model": "t2i2v", "prompt": "a green circle"}, 400, "prompt"),
    ("videos", {"model": "t2i2v", "prompt": "a red circle", "n": 9}, 400, "n"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD)
def test_bad_media_requests_name_the_field(live, route, body, status, param):
    path = "/v1/images/generations" if route == "images" else "/v1/videos"
    got, _, error = live.json("POST", path, body)
    assert got == status, error
    assert error["error"]["param"] == param
    assert param in error["error"]["message"]


def test_bad_reference_size_and_job_routes(live):
    wrong = base64.b64encode(encode_png(torch.zeros(3, 4, 4))).decode()
    body = {"model": "animator", "prompt": "a red circle", "input_reference": wrong}
    status, _, error = live.json("POST", "/v1/videos", body)
    assert (
        status == 400 and "4x4" in error["error"]["message"] and "8x8" in error["error"]["message"]
    )
    for method, path in [
        ("GET", "/v1/videos/nope"),
        ("DELETE", "/v1/videos/nope"),
        ("GET", "/v1/videos/nope/content"),
    ]:
        status, _, error = live.json(method, path)
        assert status == 404 and error["error"]["param"] == "video_id"
    status, _, job = live.json("POST", "/v1/videos", {"model": "t2i2v", "prompt": "a circle"})
    status, _, error = live.json("GET", f"/v1/videos/{job['id']}/content?variant=mp4")
    assert status == 400 and error["error"]["param"] == "variant"
    _wait(live, job["id"])
    status, _, health = live.json("GET", "/health")
    assert status == 200 and health["status"] == "ok"  # still serving
    text = live.request("GET", "/metrics")[2].decode()
    assert 'diffusion_rl_generated_images_total{model="painter"}' in text
    assert json.loads(json.dumps(health))["models"]["t2i2v"]["kind"] == "workflow"
