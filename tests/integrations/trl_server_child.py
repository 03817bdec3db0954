"""ReplayGRPOTrainer in server mode against a running vLLM server (run by test_vllm_support_engine.py with the
engine venv's Python: TRL 1.16 refuses use_vllm=True unless vLLM imports, even in server mode). Prints one
JSON line: the support source, what vLLM was asked for, TRL's first logged step.

TRL's NCCL weight-transfer set-up cannot run on a CPU: `VLLMClient.init_communicator` and
`VLLMGeneration.sync_weights` are no-ops here and one step runs, before any weight update (trainer and server
hold the same weights)."""
import json
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration

from mask_replay.integrations.trl import ReplayGRPOTrainer
from tests.integrations.trl_helpers import grpo_args, prompts, reward_len


def main(url: str, model_dir: str, out: str) -> None:
    VLLMClient.init_communicator = lambda self, device=0: None
    VLLMGeneration.sync_weights = lambda self: None
    trainer = ReplayGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"), reward_funcs=reward_len,
        args=grpo_args(out, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, top_p=0.9, max_steps=1),
        train_dataset=prompts(4), processing_class=AutoTokenizer.from_pretrained(model_dir))
    source, asked = trainer.replay_vllm_support.source, trainer.vllm_generation.logprobs
    trainer.train()
    print("RESULT " + json.dumps({"source": source, "logprobs": asked, "log": trainer.state.log_history[0]}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
