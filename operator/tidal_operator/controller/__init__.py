"""The LLMService controller's I/O side, one module per role:

    env.py        OperatorConfig from TIDAL_* variables
    ownership.py  which objects an LLMService controls (ownerReferences; pure)
    llmservice.py one reconcile pass: validate, Service, drift repair, Pod plan, status
    owned_pods.py the Pods it controls (by ownerReference uid); adopting an orphan of a planned name
    companions.py the headless Service and the PodDisruptionBudget it owns
    external_autoscaler.py  modes hpa and keda: the HPA or ScaledObject it owns
    router_secrets.py  copies of the keys the router needs, in the router's namespace
    reconciler.py one pass at a time per LLMService; bursts of triggers coalesce
    peering.py    whether this operator replica is the active one
    resync.py     the periodic safety net
    runtime.py    explicit composition: the Kube client, the reconciler, the autoscaler and the
                  adapter sync, wired together once and started and stopped together

handlers.py is only kopf wiring around `runtime.OperatorRuntime`. The pure decisions live in
reconcile/, api/ and scaling/."""
