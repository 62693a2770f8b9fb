"""Compare grammar engines (docs/structured-output.md): compile time and per-token mask time on a
real vocabulary, walking the tokens of one valid output of a JSON schema.

    pip install --no-deps -t /tmp/engines llguidance outlines-core xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/engines python benchmarks/compare_grammar_engines.py smollm2-135m llguidance,outlines,xgrammar
"""
import json, sys, time, statistics as st
import numpy as np
import edgellm

name = sys.argv[1]
engines = sys.argv[2].split(",")
m = edgellm.load(name)
tok = m.tokenizer
V = tok.vocab_size
t0 = time.perf_counter()
raw = []
for i in range(V):
    b = tok.token_bytes(i)
    if i in tok.special_ids:
        b = b"\xff" + tok.id_to_token(i).encode()
    raw.append(b)
print(f"token bytes table: {time.perf_counter()-t0:.2f}s")
eos = sorted(tok.eos_ids)
schema = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "intent": {"enum": ["billing", "bug", "feature", "other"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "intent", "tags", "address"], "additionalProperties": False}
target = json.dumps({"name": "Ada Lovelace", "age": 36, "intent": "bug", "tags": ["printer", "urgent", "office"], "address": {"city": "London", "zip": "12345"}}, separators=(",", ":"))
ids = tok.encode(target, add_special_tokens=False)
print("target tokens", len(ids))

def report(label, compile_s, times, ok):
    t = [x * 1000 for x in times]
    print(f"{label:12s} compile {compile_s*1000:8.1f} ms  mask median {st.median(t):.3f} ms  p90 {sorted(t)[int(.9*len(t))]:.3f}  max {max(t):.3f}  accepted-all={ok}")

if "llguidance" in engines:
    import llguidance as llg, llguidance.numpy as lln
    class G:
        eos_token_id = eos[0]; bos_token_id = tok.bos_id; tokens = raw
        special_token_ids = sorted(tok.special_ids)
        def __call__(self, s):
            return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s, add_special_tokens=False)
    t0 = time.perf_counter()
    llt = llg.LLTokenizer(llg.TokenizerWrapper(G()), eos_token=eos)
    print(f"llguidance tokenizer {time.perf_counter()-t0:.2f}s")
    for _ in range(2):
        t0 = time.perf_counter()
        g = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        mt = llg.LLMatcher(llt, g)
        c = time.perf_counter() - t0
        assert not mt.is_error(), mt.get_error()
        bm = lln.allocate_token_bitmask(1, V)
        times = []; ok = True
        for t in ids:
            s = time.perf_counter(); lln.fill_next_token_bitmask(mt, bm); times.append(time.perf_counter() - s)
            allowed = (bm[0, t >> 5] >> (t & 31)) & 1
            ok &= bool(allowed); mt.consume_token(t)
        s = time.perf_counter(); lln.fill_next_token_bitmask(mt, bm); times.append(time.perf_counter() - s)
        ok &= bool((bm[0, eos[0] >> 5] >> (eos[0] & 31)) & 1)
        report("llguidance", c, times, ok)

if "outlines" in engines:
    import outlines_core as oc
    t0 = time.perf_counter()
    vocab_map = {}
    for i, b in enumerate(raw):
        if i in tok.special_ids or i in eos: continue
        vocab_map.setdefault(b, []).append(i)
    voc = oc.Vocabulary(eos[0], vocab_map)
    print(f"outlines vocabulary {time.perf_counter()-t0:.2f}s")
    t0 = time.perf_counter()
    rx = oc.json_schema.build_regex_from_schema(json.dumps(schema), None)
    idx = oc.Index(rx, voc)
    c = time.perf_counter() - t0
    gd = oc.Guide(idx)
    times = []; ok = True
    mask = np.zeros((V + 31) // 32, dtype=np.int32)
    for t in ids:
        s = time.perf_counter(); gd.write_mask_into(mask.ctypes.data, mask.size, 4); times.append(time.perf_counter() - s)
        ok &= bool((mask[t >> 5] >> (t & 31)) & 1)
        gd.advance(t)
    report("outlines", c, times, ok)

if "xgrammar" in engines:
    import xgrammar as xgr, torch
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([b if not b.startswith(b"\xff") else b"" for b in raw], vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=eos, add_prefix_space=False)
    comp = xgr.GrammarCompiler(info, max_threads=2)
    print(f"xgrammar tokenizer {time.perf_counter()-t0:.2f}s")
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(schema), any_whitespace=False)
    c = time.perf_counter() - t0
    mt = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, V)
    times = []; ok = True
    for t in ids:
        s = time.perf_counter(); mt.fill_next_token_bitmask(bm); times.append(time.perf_counter() - s)
        allowed = bool((bm[0, t >> 5].item() >> (t & 31)) & 1)
        ok &= allowed
        if not allowed:
            print("rejected", repr(tok.decode([t])))
        mt.accept_token(t)
    report("xgrammar", c, times, ok)
