"""The composition root: the `specdec` command and the tools it runs.

    main        the `specdec` CLI (serve, up, demo, bench, models, certs, traces, ...)
    launch      starting the services as processes (`specdec up`, the tests' stacks)
    evaldraft   `specdec eval-draft`: a draft model's acceptance and best gamma, offline
    traces      `specdec traces`: exported spans, slowest rounds and spikes
    certs       `specdec certs`: a development PKI, one identity per role
    docgen      the generated pages of the docs (configuration, gRPC reference)

Nothing in the services (drafter, verifier, gateway) or the core (specdec) imports this
package (.importlinter).
"""
