"""BERT-style masked-LM pretraining (15% of tokens, 80/10/10) on the embedded corpus.

    python -m transformer.train --config=experiments/bert_mlm.py --workdir=runs/bert_mlm
"""

from transformer.configs import base_config


def get_config():
    config = base_config()
    config.experiment = "bert_mlm"
    config.update(steps=1000, batch_size=16, seq_len=128)
    config.model.update(family="bert", num_layers=4, d_model=128, num_heads=4, d_ff=512,
                        position="learned", max_len=128, norm="layernorm",
                        norm_placement="post", embedding_norm=True, activation="gelu",
                        init_std=0.02, dropout_rate=0.1, head="mlm")
    config.data.objective = "mlm"
    config.data.mlm_rate = 0.15
    config.optimizer.update(learning_rate=1e-3, warmup_steps=200)
    return config
