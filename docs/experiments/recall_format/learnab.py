"""Pure-recall learnability: how many steps until query digits are predicted (dn/gdn, default optimizer)."""
import sys, random, json, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import lib
from statereduce.tokenizer import byte_level_tokenizer
from statereduce.data import token_stream
from statereduce.models import tiny_config
from statereduce.pretrain import _train_cfg, lr_at, _param_groups, seed_everything
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
fam, frac, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
n_pairs = json.loads(sys.argv[4]) if len(sys.argv) > 4 else [4, 16]
over = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
kind = over.pop("kind", "mqar"); qf = over.pop("query_frac", 1.0)
cfg = _train_cfg({**lib.TRAIN, "steps": steps, **over})
def copy_doc(rng):
    s = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.randint(8, 24)))
    return s + "\n" + s + "\n" + s
gen = (lambda rng: lib.train_doc(rng, rng.choice(n_pairs), qf)) if kind == "mqar" else copy_doc
if kind == "both":
    gen = lambda rng: copy_doc(rng) if rng.random() < 0.5 else lib.train_doc(rng, rng.choice(n_pairs))
seed_everything(0)
tok = byte_level_tokenizer()
from statereduce.data import load_split
docs = load_split(lib.CORPUS, "train")
if frac >= 1:
    rng = random.Random("x"); docs = [gen(rng) for _ in range(20000)]
else:
    docs, _ = lib.mixed_docs(docs, frac, n_pairs, 1)
stream = token_stream(tok, docs)
model = AutoModelForCausalLM.from_config(tiny_config(fam, lib.ARCH[fam]), dtype=torch.float32)
opt = torch.optim.AdamW(_param_groups(model, 0.1), lr=lr_at(0, cfg), betas=(0.9, 0.95))
g = torch.Generator().manual_seed(0)
probe_copy = [copy_doc(random.Random(f"c{i}")) for i in range(20)]
rng = random.Random("diag"); probe = [lib.train_doc(rng, 4) for _ in range(20)] + [lib.train_doc(rng, 16) for _ in range(10)]
def qnll():
    model.eval(); out = {}
    with torch.no_grad():
        for n in (4, 16):
            v = []
            for d in probe:
                if d.count("\n") + 1 != 2 * n: continue
                x = torch.tensor([[256] + tok(d, add_special_tokens=False)["input_ids"]])
                nll = -torch.log_softmax(model(input_ids=x[:, :-1]).logits.float(), -1)[0].gather(1, x[0, 1:, None])[:, 0]
                S = d.index("\n") + 1; v += [nll[li * S + S - 3].item() for li in range(n, 2 * n)]
            out[n] = round(sum(v) / len(v), 2)
        v = []
        for d in probe_copy:
            x = torch.tensor([[256] + tok(d, add_special_tokens=False)["input_ids"]])
            nll = -torch.log_softmax(model(input_ids=x[:, :-1]).logits.float(), -1)[0].gather(1, x[0, 1:, None])[:, 0]
            L = d.index("\n"); v += nll[L + 1 + 1: 2 * L + 1].tolist()
        out["copy"] = round(sum(v) / len(v), 2)
    model.train(); return out
t = time.perf_counter()
for step in range(steps):
    starts = torch.randint(0, stream.numel() - 128 + 1, (int(cfg["batch_size"]),), generator=g)
    x = stream[starts[:, None] + torch.arange(128)]
    for gr in opt.param_groups: gr["lr"] = lr_at(step, cfg)
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
    if (step + 1) % 50 == 0:
        print(step + 1, round(loss.item(), 3), qnll(), round(time.perf_counter() - t), flush=True)
