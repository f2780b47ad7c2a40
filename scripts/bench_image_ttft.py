"""Time to the first token of a chat turn with one random 768x768 picture ("What is in this picture?"),
each engine in its own process, 2 threads; run gemmalite first (it writes the prompt ids that
transformers then takes, img_ids.npy in the temporary folder). Run by hand, never in CI:

    python scripts/bench_image_ttft.py gemmalite MODEL_DIR [int8]
    python scripts/bench_image_ttft.py hf MODEL_DIR            # transformers bf16, same prompt
"""
import sys, tempfile, time, json
import numpy as np
from PIL import Image
IDS = f"{tempfile.gettempdir()}/img_ids.npy"  # the prompt ids, from the gemmalite run to the transformers one
rng = np.random.default_rng(0)
img = Image.fromarray(rng.integers(0, 256, (768, 768, 3), dtype=np.uint8))
msgs = [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What is in this picture?"}]}]
which = sys.argv[1]
if which == "gemmalite":
    import gemmalite
    m = gemmalite.load(sys.argv[2], quant=(sys.argv[3] if len(sys.argv) > 3 else None))
    res = []
    for rep in range(2):
        t0 = time.perf_counter()
        s = m.session().chat(msgs, max_new_tokens=1, temperature=0, stream=True)
        for _ in s: break
        res.append(time.perf_counter() - t0)
    ids = m.tokenizer.chat_ids(msgs, add_generation_prompt=True)
    full, soft = m.with_images(ids, [img])
    print(json.dumps({"engine": "gemmalite " + " ".join(sys.argv[2:]), "ttft_s": [round(r, 2) for r in res], "prompt_tokens": int(len(full))}))
    np.save(IDS, full)
else:
    import torch
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    torch.set_num_threads(2)
    hf = Gemma4ForConditionalGeneration.from_pretrained(sys.argv[2], dtype=torch.bfloat16).eval()
    vc = hf.config.vision_config
    proc = Gemma4ImageProcessorPil(patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size, max_soft_tokens=280)
    ids = torch.tensor(np.load(IDS))[None]
    res = []
    for rep in range(2):
        t0 = time.perf_counter()
        out = proc(img, return_tensors="pt")
        with torch.no_grad():
            hf.generate(input_ids=ids, pixel_values=out["pixel_values"].to(torch.bfloat16), image_position_ids=out["image_position_ids"],
                        max_new_tokens=1, do_sample=False)
        res.append(time.perf_counter() - t0)
    print(json.dumps({"engine": "transformers bf16", "ttft_s": [round(r, 2) for r in res], "soft": int(out["num_soft_tokens_per_image"][0])}))
