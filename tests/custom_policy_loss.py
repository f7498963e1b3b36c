"""A user's own policy loss, registered outside the library (tests/test_policy_losses.py loads it
by ``actor.policy_loss: tests.custom_policy_loss:doubled_dapo``)."""

from nemo_dapo.algo.policy_losses import dapo_loss, register_policy_loss


@register_policy_loss("doubled_dapo")
def doubled_dapo(old_log_prob, log_prob, advantages, mask, settings):
    loss, metrics = dapo_loss(old_log_prob, log_prob, advantages, mask, settings)
    return 2 * loss, metrics
