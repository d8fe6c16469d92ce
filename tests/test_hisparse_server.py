"""`shadowradix serve --hisparse-buffer N`: greedy answers equal transformers' with the
C4 history in host memory, and HiSparse's lookups and bytes reach /metrics and
/server_info."""

import httpx
import torch
from server_util import ServerThread, metrics, wait_for
from tiny_model import greedy_tokens

from shadowradix.demo import tiny_deepseek_v4

BUFFER = 17  # the demo model's index_topk (16) + 1


def test_greedy_generation_through_hot_buffers_is_transformers_greedy():
    server = ServerThread.from_args("--model", "tiny", "--hisparse-buffer", str(BUFFER),
                                    "--hisparse-requests", "4", "--step-tokens", "128",
                                    "--state-tokens", "512")
    try:
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (40, 200)]
        outs = []
        for ids in prompts:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 24,
                                                           "temperature": 0,
                                                           "ignore_eos": True}}
            outs.append(httpx.post(f"{server.url}/generate", json=body, timeout=120).json())
        model = tiny_deepseek_v4()
        for ids, out in zip(prompts, outs, strict=True):
            assert out["output_ids"] == greedy_tokens(model, ids, 24)
        wait_for(lambda: metrics(server.url)["shadowradix:hisparse_buffers_in_use"] == 0)
        m = metrics(server.url)
        # 40 + 24 tokens hold 16 C4 entries (the fast path); 200 hold 50, more than the
        # buffer: its lookups hit and miss.
        assert m["shadowradix:hisparse_lookups_total{result=miss}"] > 0
        assert m["shadowradix:hisparse_lookups_total{result=hit}"] > 0
        assert m["shadowradix:hisparse_lookups_total{result=fast_path}"] > 0
        assert m["shadowradix:hisparse_bytes_total"] > 0
        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
        assert info["hisparse_buffer"] == BUFFER and info["hisparse_requests"] == 4
        assert info["state_tokens"] == 512 and info["cache_policy"] == "shadowradix"
    finally:
        server.stop()
