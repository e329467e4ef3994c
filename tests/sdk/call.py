"""Drives one official SDK against the gateway, as an application would, and prints what it got.

Run by tests/e2e/sdks.rs: `call.py <sdk> <scenario> <base url>`. Prints one JSON line:
`{"results": [...], "seconds": ...}`, each result `{"id": ...}` or `{"error": <class>, "status": ...}`.
Scenarios:
- reused: two creates with one key and different parameters;
- concurrent: two creates with one key at once (the second while the first is in flight);
- once: one create, with the SDK's own retries (a lost answer, a store down for a while);
- timeout: one create with a 1 s client timeout against a slower upstream (the SDK's retry is a
  duplicate while the original runs);
- again: one create; on an error, waits for a line on stdin and makes it again with the same key
  (an application's own retry, for an SDK that does not retry statuses).
"""

import json
import sys
import threading
import time
import uuid


def stripe_create(base, timeout, retries):
    import stripe

    client = stripe.StripeClient(
        "sk_test_idemgate",
        base_addresses={"api": base},
        max_network_retries=retries,
        http_client=stripe.RequestsClient(timeout=timeout),
    )

    def create(key, n):
        customer = client.v1.customers.create(
            params={"email": f"buyer{n}@example.com"}, options={"idempotency_key": key}
        )
        return customer.id

    return create


def moderntreasury_create(base, timeout, retries):
    import modern_treasury

    client = modern_treasury.ModernTreasury(
        api_key="mt_idemgate",
        organization_id="org_idemgate",
        base_url=base,
        max_retries=retries,
        timeout=timeout,
    )

    def create(key, n):
        return client.counterparties.create(name=f"Buyer {n}", idempotency_key=key).id

    return create


def gocardless_create(base, timeout, retries):
    import gocardless_pro

    client = gocardless_pro.Client(access_token="gc_idemgate", base_url=base, timeout=timeout)

    def create(key, n):
        customer = client.customers.create(
            params={"email": f"buyer{n}@example.com"}, headers={"Idempotency-Key": key}
        )
        return customer.id

    return create


SDKS = {
    "stripe": stripe_create,
    "moderntreasury": moderntreasury_create,
    "gocardless": gocardless_create,
}


def outcome(create, key, n):
    try:
        return {"id": create(key, n)}
    except Exception as e:  # the SDK's own error class is what is tested
        status = getattr(e, "http_status", None) or getattr(e, "status_code", None)
        if status is None and getattr(e, "error", None) is not None:
            status = e.error.get("code") if isinstance(e.error, dict) else None
        return {"error": type(e).__name__, "status": status, "message": str(e)[:300]}


def main():
    sdk, scenario, base = sys.argv[1], sys.argv[2], sys.argv[3]
    timeout = 1.0 if scenario == "timeout" else 20.0
    create = SDKS[sdk](base, timeout, 5)
    key = str(uuid.uuid4())
    started = time.monotonic()
    if scenario == "reused":
        results = [outcome(create, key, 1), outcome(create, key, 2)]
    elif scenario == "concurrent":
        results = [None, None]

        def run(i):
            results[i] = outcome(create, key, 1)

        first = threading.Thread(target=run, args=(0,))
        first.start()
        # The second once the first is surely at the upstream (the test's upstream holds it).
        time.sleep(0.3)
        run(1)
        first.join()
    elif scenario in ("once", "timeout"):
        results = [outcome(create, key, 1)]
    elif scenario == "again":
        results = [outcome(create, key, 1)]
        if "error" in results[0]:
            print(json.dumps({"waiting": results[0]}), flush=True)
            sys.stdin.readline()
            results.append(outcome(create, key, 1))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(json.dumps({"results": results, "seconds": round(time.monotonic() - started, 2)}), flush=True)


if __name__ == "__main__":
    main()
