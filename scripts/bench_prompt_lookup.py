#!/usr/bin/env python3
"""Prompt lookup on the bundled Gemma 3 270M: a summarisation and an edit prompt, greedy chat,
200 new tokens, with and without `prompt_lookup`, alternated twice; prints tokens/s and whether
the texts are identical. Run by hand: `python scripts/bench_prompt_lookup.py [--new-tokens N] [--rounds R]`."""
import argparse
import json

import gemmalite

TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Residents said the lanes "
        "made the street safer for children walking to school, but shop owners complained that the loss of parking "
        "spaces had reduced the number of customers visiting their stores. The council agreed to study the effect on "
        "local businesses for six months before deciding whether to keep the lanes, and asked the transport department "
        "to count cyclists and parked cars every week. A final vote is expected in the spring, after a public hearing "
        "at which residents, shop owners and cyclists will all be invited to speak.")
PROMPTS = {
    "summarise": "Summarise the following text in a few sentences, keeping its key facts.\n\n" + TEXT,
    "edit": "Rewrite the following text with 'bicycle' replaced by 'bike' everywhere, changing nothing else.\n\n" + TEXT,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="plain / lookup alternations per prompt")
    a = ap.parse_args()
    model = gemmalite.load("gemma3-270m", context=2048)
    model.session().chat([{"role": "user", "content": "hi"}], max_new_tokens=4, temperature=0.0)  # warm up / compile
    for name, p in PROMPTS.items():
        msgs = [{"role": "user", "content": p}]
        res = {}
        for rep in range(a.rounds):
            for pl in (False, True):
                s = model.session().chat(msgs, max_new_tokens=a.new_tokens, temperature=0.0, stream=True,
                                         prompt_lookup=pl)
                text = "".join(s)
                st = s.stats
                res.setdefault(pl, []).append((st.new_tokens / st.decode_s, st.new_tokens, st.draft_tokens,
                                               st.accepted_tokens, text))
        same = all(r[4] == res[False][0][4] for r in res[False] + res[True])
        print(json.dumps({"prompt": name, "identical_text": same,
                          "plain_tok_s": [round(r[0], 1) for r in res[False]],
                          "lookup_tok_s": [round(r[0], 1) for r in res[True]],
                          "new_tokens": res[True][0][1], "drafted": res[True][0][2], "accepted": res[True][0][3]}))
        print("TEXT:", json.dumps(res[True][0][4][:300]))


if __name__ == "__main__":
    main()
