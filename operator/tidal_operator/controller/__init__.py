"""The LLMService controller's I/O side, one module per role:

    env.py        OperatorConfig from TIDAL_* variables
    ownership.py  which Pods an LLMService controls (ownerReferences)
    llmservice.py one reconcile pass: validate, Service, drift repair, Pod plan, status
    reconciler.py one pass at a time per LLMService; bursts of triggers coalesce
    peering.py    whether this operator replica is the active one
    resync.py     the periodic safety net
    runtime.py    explicit composition: the Kube client, the reconciler, the autoscaler and the
                  adapter sync, wired together once and started and stopped together

handlers.py is only kopf wiring around `runtime.OperatorRuntime`. The pure decisions live in
reconcile/, api/ and scaling/."""
