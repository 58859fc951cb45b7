"""The reward side of the producer: user rewards, loaded and called for each group.

A user reward is any of:
- a function ``r(prompt, completion: str, **meta) -> float`` (sync or async);
- a class, instantiated once with ``RewardSpec.kwargs`` (setup state: a loaded verifier, an HTTP
  client); its ``__call__`` is the scorer, sync or async, with the signature above;
- a batched scorer (``batched=True``):
  ``(prompts: list, completions: list[str], metas: list[dict]) -> list[float]``, sync or async;
- a TRL GRPOTrainer reward as it is (``style="trl"``, or detected from its signature):
  ``f(completions, **kwargs) -> list[float | None]``, called once per group with the keywords
  ``prompts``, ``completions``, ``completion_ids`` and one list per dataset column; a ``None``
  entry means "not scored by this reward".
``meta`` carries the dataset record's extra fields (e.g. ``answer``) plus ``prompt_id`` and
``completion_index``. A scorer whose signature has no ``**meta`` receives only the keywords it
names. ``@reward(name=..., batched=..., weight=...)`` (``from pipeline import reward``) attaches
defaults that a spec may override. A prompt is the dataset's value: a string, or a list of
messages for conversational data.

Modules, each owning one thing:
- ``loading``: a spec's reward imported, its defaults and calling convention, built once;
- ``call``: calling one reward: the only call of user code (``invoke``), its limits and timeout
  (``call_reward``) and the coercion of its result (``coerce``);
- ``executors``: the ``thread`` and ``process`` executors (daemon threads, a spawn pool);
- ``ray_replicas``: ``executor: ray``, replicas on a Ray cluster shared by the run's producers;
- ``runner``: ``RewardSet``, every reward of the run scoring one group, with failure handling
  and counters.
"""
