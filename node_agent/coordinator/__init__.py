"""The coordinator agent: requests in, token loop through the stages, responses out.

    gateway --request--> coordinator --TOKENS--> stage 0 --HIDDEN--> ... --> stage N-1
                              ^                                                  |
                              +------------------CANDIDATES----------------------+
                         sample, stream delta, stop?  --response--> gateway

The coordinator holds the tokenizer and no weights. Its rooms, in the order a
request meets them:

- agent.py: the agent, its rooms wired to the plant's bus; `edgebus coordinator`.
- intake.py: a request message parsed, admitted, journaled, answered once.
- waiting_room.py: requests the plant cannot start yet, bounded, fair across gateways.
- token_loop.py: an admitted request's steps through the stages, and sampling.
- routing.py: routes over the stages' replica nodes, and failover.
- drafting.py: speculation drafts sent behind a request's token.
- delivery.py: where answers go, and how they leave.
- peers.py: the plant's other coordinators, and serving a dead one's requests.
- generation.py: one request in flight, as the rooms above share it.

Failover. A request runs down one route (one node per stage) and stays there,
because its KV caches live on those nodes. When a node of its route dies, or
a frame of it is lost, bad or refused, the request is replayed: the tokens so
far, prompt plus generated, go as a prefill down a healthy route under a new
route epoch, and generation goes on from there. Sampling state lives here, so
the output is the same as without the fault. Frames of the old epoch are
ignored.

Restarts. A request is journaled on disk before it is acknowledged to the
broker and forgotten once its answer has been; a coordinator that starts
answers what its journal holds, and the broker delivers again what was never
acknowledged. A plant may run several coordinators at once
(`coordinator.instances`, MQTT 5): they share the request subscription, and
when one goes offline another serves the requests the broker keeps in the
dead one's session until it is back. docs/failover.md has the whole story, and
the faults each part answers.
"""
