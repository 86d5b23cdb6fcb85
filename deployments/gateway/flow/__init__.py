"""Flow control: which class a request is in, whether it is admitted, and when it goes to the replicas.

One room (issue 52, item 8): the request path (`shunter.deployments.gateway.forward`) calls `door.FlowControl`
at three points (the class at the door, the early refusal of a full model before the body is parsed, and
`admit` once the quota is taken), and everything else about who waits, who goes first and who is turned
away lives here:

- `priority`: a request's class (OpenAI's and Anthropic's `service_tier`, the priority header, the key's
  default) and the engine priority it carries;
- `admission`: each model's gate, counting admitted work against known capacity by class and by each
  tenant's fair part of its class;
- `queue`: the flow queue, which lets admitted requests go to the replicas by class, headroom and
  weighted fair share;
- `retry_places`: the places a refusal keeps for its retry;
- `door`: `FlowControl`, the three calls.

The gates and queues themselves are kept per model by `serving_state.ServingState`, beside the model's
routing state. Nothing here imports the forwarder; the forwarder imports only `door` and `priority`'s
header name.
"""
