"""The generation actor: one model, one streaming engine loop, detokenization, audit, fault injection."""
