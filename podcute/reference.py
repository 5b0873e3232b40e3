def pod_attention_reference(*a, **k): raise NotImplementedError
