"""Models and checks the PyTorch activation tests share (test_torch_activations.py,
test_torch_replay_statistics.py, test_torch_storages.py): a small MLP and a CNN with BatchNorm, a
training step that returns its loss and gradients, and the checks of bit-identical results and of
running statistics updated once."""

import torch


def mlp(width=256, depth=6):
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
    return torch.nn.Sequential(*layers)


def cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(16 * 16 * 16, 10))


def step(model, x, forward):
    torch.manual_seed(1234)
    model.zero_grad(set_to_none=True)
    loss = forward(model, x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_identical(test, a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    test.assertTrue(torch.equal(loss_a, loss_b), f"loss {loss_a} != {loss_b}")
    for ga, gb in zip(grads_a, grads_b):
        test.assertTrue(torch.equal(ga, gb), "a gradient differs")


def assert_updated_once(test, plain, model):
    """BatchNorm running statistics as a plain run left them: updated by the forward only, not
    again by the recomputations."""
    for bn_ref, bn in zip([m for m in plain.modules() if isinstance(m, torch.nn.BatchNorm2d)],
                          [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]):
        test.assertTrue(torch.equal(bn_ref.running_mean, bn.running_mean))
        test.assertTrue(torch.equal(bn_ref.running_var, bn.running_var))
        test.assertEqual(int(bn.num_batches_tracked), 1)
