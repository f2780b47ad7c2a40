import time, sys
t0 = time.perf_counter()
import gemmalite
t1 = time.perf_counter()
m = gemmalite.load("gemma3-270m")
t2 = time.perf_counter()
s = m.generate("The three most famous painters of the Renaissance were", stream=True, temperature=0, max_new_tokens=8)
first = next(iter(s))
t3 = time.perf_counter()
print(f"import {t1-t0:.2f} load {t2-t1:.2f} first {t3-t2:.2f} total {t3-t0:.2f}", file=sys.stderr)
